"""What the routers share: access to the app's handlers and documented error responses."""

from __future__ import annotations

from typing import Any, cast

from starlette.requests import Request

from servelm.api.responses import ErrorResponse
from servelm.api.state import AppState

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request (the field is named in `param`)."},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key."},
    404: {"model": ErrorResponse, "description": "Unknown model."},
    413: {"model": ErrorResponse, "description": "Request body too large."},
    408: {"model": ErrorResponse, "description": "The request ran past the server's request timeout."},
    429: {"model": ErrorResponse, "description": "Rate limit hit, or the server's queue is full (see Retry-After)."},
    503: {
        "model": ErrorResponse,
        "description": "Models are still loading, the server is shutting down, or the engine is down.",
    },
}


def app_state(request: Request) -> AppState:
    """The handlers of the app serving this request."""
    return cast(AppState, request.app.state.servelm)
