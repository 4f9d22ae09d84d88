"""OpenAI's error envelope and the exception handlers that produce it.

Every error the API returns has the shape
``{"error": {"message", "type", "param", "code"}}``. Handlers here turn the
exceptions raised anywhere below the app (validation, connector, sampling
parameters, unknown routes) into that envelope with the right status.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servelm.api.access_log import request_record
from servelm.api.request_model import SURROGATE_ERROR
from servelm.connectors.base import ContextLengthExceeded
from servelm.engine.context_limit import context_length_error
from servelm.engine.sampling_params import SamplingParamsError
from servelm.errors import APIError as APIError  # re-exported: the API layer's one error type
from servelm.errors import default_error_type

logger = logging.getLogger("servelm.api")

# pydantic puts union members and wrapper validators in an error's location
# ("str", "list[int]", "function-after[...]"); they mean nothing to a client.
_LOC_NOISE = re.compile(r"[\[\]\-]|^(str|int|float|bool|list|dict|none|json-or-python|tagged-union)$")
# pydantic quotes expected values the Python way ('float'); a JSON API shows them as JSON ("float").
_PY_QUOTED = re.compile(r"'([^'\\]*)'")
# What Starlette/FastAPI say when the body is not decodable JSON at all (invalid
# UTF-8, nesting past the parser's recursion limit): not a JSONDecodeError.
_UNPARSABLE_BODY = "There was an error parsing the body"
# Longest JSON rendering of a rejected value quoted back in a message.
_MAX_SHOWN = 80


# Retry-After (seconds) of a 503: the server is loading its models or shutting
# down, which takes seconds; a full queue's 429 has its own (admission.py).
UNAVAILABLE_RETRY_AFTER_S = 5


class ServerOverloaded(APIError):
    """429 ``server_overloaded``: the engine's waiting queue is full (``code`` ``queue_full``)
    or the request waited in it past ``queue_timeout`` (``code`` ``queue_timeout``).

    It carries ``Retry-After``; clients (the OpenAI SDKs included) retry a 429.
    """

    def __init__(self, message: str, *, code: str, retry_after_s: int):
        super().__init__(
            message, status=429, type="server_overloaded", code=code, headers={"Retry-After": str(retry_after_s)}
        )


class ServerShuttingDown(APIError):
    """503 ``server_shutting_down``: the server is draining before it exits.

    New requests get it at once; requests still running when the shutdown
    timeout ends get it as their error. ``Retry-After`` points clients at
    another replica or the restarted server.
    """

    def __init__(self) -> None:
        super().__init__(
            "The server is shutting down and takes no new work. Retry after the time in the Retry-After header.",
            status=503,
            code="server_shutting_down",
            headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
        )


class RequestTimedOut(APIError):
    """408 ``request_timeout``: the request ran longer than ``request_timeout`` and was aborted."""

    def __init__(self, timeout_s: float):
        super().__init__(
            f"The request did not finish within the server's request timeout ({timeout_s:g} s) and was aborted.",
            status=408,
            type="timeout_error",
            code="request_timeout",
        )


class ClientDisconnected(Exception):
    """The client went away before its response was ready; nothing is sent."""


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The envelope as a dict."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    *,
    type: str | None = None,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """A JSON response carrying the envelope."""
    return JSONResponse(
        error_body(message, type or default_error_type(status), param, code), status_code=status, headers=headers
    )


def api_error_from(exc: BaseException) -> APIError:
    """Map any exception to the APIError a client should see.

    Unknown exceptions become a 500 whose message hides the details: they are
    logged with their traceback by the caller, never sent.
    """
    if isinstance(exc, APIError):  # a ConnectorError too
        return exc
    if isinstance(exc, SamplingParamsError):
        return APIError(str(exc), status=400, param=exc.param, code=exc.code)
    return APIError("The server had an error while processing your request.", status=500)


def with_param_renamed(err: APIError, names: dict[str, str]) -> APIError:
    """``err`` naming the request field a client used instead of the engine's name for it.

    ``names`` maps engine names (``max_tokens``, ``structured_outputs.json``)
    to request fields (``max_completion_tokens``, ``guided_json``); the
    message's leading name is replaced too. Other errors come back as they are.
    """
    field = names.get(err.param) if err.param is not None else None
    if field is None or err.param is None:
        return err
    message = err.message
    if message.startswith(err.param):
        message = field + message[len(err.param) :]
    return APIError(message, status=err.status, type=err.type, param=field, code=err.code, headers=err.headers)


def context_length_exceeded(
    max_model_len: int, prompt_tokens: int, max_tokens: int | None, where: str = "messages"
) -> ContextLengthExceeded | None:
    """The error for a prompt plus completion that does not fit the context, or None if it fits.

    ``where`` is also the error's ``param``; the rule and the wording are the
    engine's (:func:`servelm.engine.context_limit.context_length_error`).
    """
    message = context_length_error(max_model_len, prompt_tokens, max_tokens, where)
    return None if message is None else ContextLengthExceeded(message, param=where)


def format_loc(loc: tuple[Any, ...]) -> str | None:
    """Turn a pydantic error location into a JSON-ish path: ``messages[0].content``."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            if parts:
                parts[-1] += f"[{item}]"
            continue
        if not isinstance(item, str) or _LOC_NOISE.search(item):
            continue
        parts.append(item)
    if parts and parts[0] == "body":
        parts = parts[1:]
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> APIError:
    """The first validation error as a 400 naming the field."""
    errors = exc.errors()
    if not errors:
        return APIError("Invalid request.", status=400)
    err = errors[0]
    kind = err.get("type", "")
    param = format_loc(tuple(err.get("loc", ())))
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return APIError(f"The request body is not valid JSON: {detail}".rstrip(": "), status=400, code="invalid_json")
    if param is None and kind in ("model_attributes_type", "dict_type", "model_type", "missing"):
        return APIError(
            "The request body must be a JSON object (send it with Content-Type: application/json).", status=400
        )
    if kind == "extra_forbidden":
        return APIError(f"Unrecognized request argument supplied: {param}", status=400, param=param)
    if kind == "missing":
        return APIError(f"Missing required parameter: '{param}'.", status=400, param=param)
    if kind == SURROGATE_ERROR:
        where = (err.get("ctx") or {}).get("field") or ""
        param = ".".join(p for p in (param, where) if p).replace(".[", "[") or None
        return APIError(
            f"Invalid value for '{param or 'body'}': a string (or key) holds a lone UTF-16 surrogate "
            "(e.g. \\ud800), which is not valid Unicode text.",
            status=400,
            param=param,
        )
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    msg = _PY_QUOTED.sub(r'"\1"', msg).rstrip(".")
    return APIError(f"Invalid value for '{param}': {msg}{_shown(err.get('input'))}.", status=400, param=param)


def json_value(value: Any) -> str:
    """``value`` as JSON for an error message (``true``, not ``True``); shortened if long."""
    try:
        text = json.dumps(value, separators=(", ", ": "), default=str)
    except (TypeError, ValueError):
        text = json.dumps(str(value))
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def _shown(value: Any) -> str:
    """ ", got <value>" for a scalar the client sent; nothing for objects, lists or absent values."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return f", got {json_value(value)}"
    return ""


def install_exception_handlers(app: FastAPI) -> None:
    """Register the handlers that render every known exception as an envelope."""

    async def on_api_error(request: Request, exc: Exception) -> Response:
        err = api_error_from(exc)
        return error_response(
            err.status, err.message, type=err.type, param=err.param, code=err.code, headers=err.headers
        )

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        err = validation_error(exc)
        return error_response(err.status, err.message, type=err.type, param=err.param, code=err.code)

    async def on_http_exception(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        if status == 404:
            message, code = f"Invalid URL ({request.method} {request.url.path})", "unknown_url"
        elif status == 405:
            message, code = f"Method {request.method} is not allowed for {request.url.path}", "method_not_allowed"
        elif status == 400 and exc.detail == _UNPARSABLE_BODY:
            message = (
                "The request body is not valid JSON: it could not be decoded (invalid UTF-8, nested too deeply, "
                "or an integer of more than 4300 digits)."
            )
            code = "invalid_json"
        else:
            message, code = str(exc.detail), None
        return error_response(status, message, code=code, headers=getattr(exc, "headers", None))

    async def on_disconnect(request: Request, exc: Exception) -> Response:
        # 499 (nginx's "client closed request") only shows in metrics and logs.
        return Response(status_code=499)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(SamplingParamsError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(ClientDisconnected, on_disconnect)


class CatchAllMiddleware:
    """Last line of defence: an unexpected exception becomes a 500 envelope, never a traceback.

    It sits inside the metrics middleware so a 500 is counted, and logs the
    traceback server-side.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            record = request_record(HTTPConnection(scope))
            request_id = record.request_id if record is not None else "-"
            logger.exception(
                "unhandled error in %s %s (request %s)", scope.get("method"), scope.get("path"), request_id
            )
            if started:
                return  # too late for a status; the stream just ends
            err = api_error_from(RuntimeError())
            message = f"{err.message.rstrip('.')} (request id {request_id})."
            response = error_response(err.status, message, type=err.type)
            await response(scope, receive, send)
