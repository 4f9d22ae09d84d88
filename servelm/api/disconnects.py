"""Marking a request whose client went away, so the access log and the metrics say 499.

A streamed response has sent its 200 before the client leaves, so the status
on the wire cannot tell an aborted stream from a finished one. The response
marks the request's scope instead, and the access log and the metrics
report 499 (nginx's "client closed request") for it, as they already do for
a non-streamed request whose client left before its answer.
"""

from __future__ import annotations

from starlette.types import Scope

CLIENT_CLOSED_REQUEST = 499
_GONE = "servelm.client_gone"  # key in the request's scope["state"]


def mark_client_gone(scope: Scope) -> None:
    """Record that the client disconnected before its response ended."""
    scope.setdefault("state", {})[_GONE] = True


def logged_status(scope: Scope, status: int) -> int:
    """The status to log and count: 499 for a request whose client left early, else ``status``."""
    return CLIENT_CLOSED_REQUEST if scope.get("state", {}).get(_GONE) else status
