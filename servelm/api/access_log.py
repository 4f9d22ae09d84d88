"""Request ids and the access log: one line per request on the ``servelm.access`` logger.

Each request gets an id: the client's ``x-request-id`` when it sent a
usable one, else a new one; the response carries it back in
``x-request-id``. Handlers add what only they know (token counts, the time
of the first streamed token) to the request's :class:`RequestRecord`, and
:class:`AccessLogMiddleware` logs it when the response has ended.
``configure_logging`` sets up text or JSON lines for the whole process.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from starlette.requests import HTTPConnection
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servelm.api.disconnects import logged_status
from servelm.api.metrics import route_label

ACCESS_LOGGER = "servelm.access"
REQUEST_ID_HEADER = "x-request-id"
_RECORD = "servelm.request"  # key in the request's scope["state"]
# Printable ASCII without spaces, bounded: a client's id goes into logs and
# headers verbatim, so anything else is replaced by a fresh one.
_USABLE_ID = re.compile(r"^[\x21-\x7e]{1,128}$")


@dataclass
class RequestRecord:
    """What the access log says about one request; handlers fill in the token counts and TTFT.

    ``request_id`` is what ``x-request-id`` carries; ``generated_id`` is the
    server's own id for the request, which response ids (``chatcmpl-...``)
    are built from: it is unique even when clients reuse their ids. Times
    are ``time.perf_counter()`` readings.
    """

    request_id: str
    generated_id: str
    started: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_token_at: float | None = None


def request_record(conn: HTTPConnection) -> RequestRecord | None:
    """The record :class:`AccessLogMiddleware` keeps for this request (None outside it)."""
    return cast("RequestRecord | None", conn.scope.get("state", {}).get(_RECORD))


def response_id(conn: HTTPConnection, new_id: Callable[[], str]) -> str:
    """The id to build this request's response id from: its generated request id, else ``new_id()``."""
    record = request_record(conn)
    return record.generated_id if record is not None else new_id()


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


class AccessLogMiddleware:
    """Gives each request its id, returns it in ``x-request-id``, logs one line when it ends.

    Sits outside every other middleware but CORS, so rejected requests
    (401, 413, 429) and unexpected errors (500) are logged too, with the
    status the client saw. A streamed response is logged after its last
    byte, so its total time covers the whole stream; a stream whose client
    left before its end is logged as 499, as the metrics count it.
    """

    def __init__(
        self,
        app: ASGIApp,
        new_id: Callable[[], str],
        routes: Sequence[BaseRoute] = (),
        timer: Callable[[], float] = time.perf_counter,
    ):
        self.app = app
        self.new_id = new_id
        self.routes = routes
        self.timer = timer
        self.logger = logging.getLogger(ACCESS_LOGGER)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        generated = self.new_id()
        sent = ""
        for name, value in scope.get("headers", ()):
            if name == REQUEST_ID_HEADER.encode():
                sent = value.decode("latin-1")
                break
        record = RequestRecord(
            request_id=sent if _USABLE_ID.match(sent) else generated,
            generated_id=generated,
            started=self.timer(),
        )
        scope.setdefault("state", {})[_RECORD] = record
        status = 500
        id_header = (REQUEST_ID_HEADER.encode(), record.request_id.encode())

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), id_header]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self._log(scope, record, logged_status(scope, status), self.timer())

    def _log(self, scope: Scope, record: RequestRecord, status: int, ended: float) -> None:
        if not self.logger.isEnabledFor(logging.INFO):
            return
        client = scope.get("client")
        ttft = None if record.first_token_at is None else record.first_token_at - record.started
        fields: dict[str, Any] = {
            "request_id": record.request_id,
            "method": scope.get("method", ""),
            "path": scope.get("path", ""),
            "route": route_label(scope, self.routes),
            "status": status,
            "client": client[0] if client else None,
            "prompt_tokens": record.prompt_tokens,
            "completion_tokens": record.completion_tokens,
            "ttft_s": _seconds(ttft),
            "duration_s": _seconds(ended - record.started),
        }

        def shown(value: Any, unit: str = "") -> str:
            return "-" if value is None else f"{value}{unit}"

        self.logger.info(
            '%s %s "%s %s" %s prompt_tokens=%s completion_tokens=%s ttft=%s total=%s',
            record.request_id,
            shown(fields["client"]),
            fields["method"],
            fields["path"],
            status,
            shown(fields["prompt_tokens"]),
            shown(fields["completion_tokens"]),
            shown(fields["ttft_s"], "s"),
            shown(fields["duration_s"], "s"),
            extra={"access": fields},
        )


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and an access line's fields."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        data.update(getattr(record, "access", None) or {})
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, ensure_ascii=False, default=str)


TEXT_FORMAT = "%(levelname)s %(name)s: %(message)s"


def configure_logging(level: str, fmt: str) -> None:
    """Send every log line of the process (uvicorn's too, when it leaves logging to us) to stderr.

    ``fmt`` is ``text`` (``LEVEL logger: message``) or ``json``
    (:class:`JsonFormatter`).
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
