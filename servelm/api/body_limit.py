"""Request body size limit: 413 before the app parses anything too large."""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servelm.api.errors import error_response


class BodyLimitMiddleware:
    """Rejects bodies over ``max_body_bytes`` with a 413 envelope.

    ``Content-Length`` is checked first; a chunked body is counted as it
    arrives. The body is buffered here (it is at most the limit) and
    replayed to the app, after which ``receive`` passes through so the app
    still hears ``http.disconnect``.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self, size: int | None = None) -> JSONResponse:
        size_text = f"{size} bytes" if size is not None else "more bytes than that"
        return error_response(
            413,
            f"Request body too large: the limit is {self.max_body_bytes} bytes, got {size_text}.",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await error_response(400, "Invalid Content-Length header.")(scope, receive, send)
                    return
                if declared > self.max_body_bytes:
                    await self._too_large(declared)(scope, receive, send)
                    return
                break

        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                # Disconnected while sending the body: nothing to answer.
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large()(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
