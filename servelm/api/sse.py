"""Server-sent events as OpenAI streams them: ``data: {json}\\n\\n`` and a final ``data: [DONE]``."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from servelm.api.disconnects import mark_client_gone

logger = logging.getLogger("servelm.api")

DONE_EVENT = "data: [DONE]\n\n"

# Characters that JSON leaves raw but str.splitlines() (and so httpx's aiter_lines) breaks lines at.
# SSE ends lines at CR and LF alone, yet clients that read a stream with splitlines() are common:
# escaped, a token that decodes to one of these cannot cut an event in two for them.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse_event(payload: BaseModel | dict[str, Any], exclude: set[str] | None = None) -> str:
    """One SSE event carrying ``payload`` as compact JSON, on one line for any line splitter."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json(exclude=exclude)
    else:
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data.translate(_LINE_BREAKS)}\n\n"


class EventStreamResponse(StreamingResponse):
    """A streamed ``text/event-stream`` response that always notices a client leaving.

    Starlette only listens for ``http.disconnect`` on older ASGI servers;
    this response always does, so a client that goes away while the engine
    is still thinking cancels the stream at once. ``on_close`` runs exactly
    once when the response ends for any reason (finished, client gone,
    never started), shielded from cancellation: it is where the request is
    aborted in the engine.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]] | None = None):
        super().__init__(
            events,
            media_type=self.media_type,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                complete = False  # the last body message has been handed to the server

                async def tracking_send(message: Message) -> None:
                    nonlocal complete
                    if message["type"] == "http.response.body" and not message.get("more_body", False):
                        complete = True
                    await send(message)

                async def stream() -> None:
                    try:
                        await self.stream_response(tracking_send)
                    except OSError:
                        mark_client_gone(scope)  # the client went away mid-write (ASGI spec 2.4 servers)
                    tg.cancel_scope.cancel()

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    if not complete:
                        mark_client_gone(scope)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(watch)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                if self._on_close is not None:
                    await self._on_close()
