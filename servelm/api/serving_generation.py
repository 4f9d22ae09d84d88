"""Chat and text completions' shared response path: run a :class:`GenerationRun`, then answer
with an SSE stream or one JSON body built by the endpoint's :class:`ResponseFormatter`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Protocol

import anyio
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from servelm.api.access_log import request_record
from servelm.api.errors import APIError, api_error_from, error_body
from servelm.api.generation_run import ChoiceDelta, ChoiceResult, GenerationRun
from servelm.api.ratelimit import rate_limit_ticket
from servelm.api.responses import Usage
from servelm.api.serving_base import OpenAIServing, cancel_on_disconnect
from servelm.api.sse import DONE_EVENT, EventStreamResponse, sse_event

logger = logging.getLogger("servelm.api")


class ResponseFormatter(Protocol):
    """The endpoint-specific JSON of a generation response."""

    include_usage: bool

    def stream_prologue(self) -> list[BaseModel]:
        """Chunks sent before any output (chat: each choice's role)."""
        ...

    def stream_chunks(self, delta: ChoiceDelta, run: GenerationRun) -> list[BaseModel]:
        """Chunks for one choice delta."""
        ...

    def usage_chunk(self, usage: Usage) -> BaseModel:
        """The final chunk of a stream with ``include_usage``."""
        ...

    def response(self, choices: list[ChoiceResult], run: GenerationRun) -> BaseModel:
        """The non-streamed response."""
        ...


class GenerationServing(OpenAIServing):
    """Base of chat and text completions: runs a request and renders it streamed or not."""

    async def respond(
        self, raw_request: Request, run: GenerationRun, formatter: ResponseFormatter, stream: bool
    ) -> Response:
        """Start ``run`` and answer with an SSE stream or one JSON body.

        With rate limits on, the run's most tokens are reserved first (429
        if they do not fit) and corrected to what it used when it ends.
        The app's :class:`Admission` settings bound the engine's queue and
        the run's time (see :meth:`GenerationRun.start`).
        """
        ticket = rate_limit_ticket(raw_request)
        if ticket is not None:
            await ticket.reserve_tokens(run.max_total_tokens)
        record = request_record(raw_request)
        if record is not None:
            run.received_at = record.started
        lifecycle = self.ctx.lifecycle
        lifecycle.track(run)

        async def finish() -> None:
            # Runs once the run is over, however it ended.
            with anyio.CancelScope(shield=True):
                await run.close()
                lifecycle.untrack(run)
                if record is not None:
                    record.prompt_tokens = run.prompt_tokens
                    record.completion_tokens = run.completion_tokens
                    if stream:
                        record.first_token_at = run.first_token_at
                if ticket is not None:
                    await ticket.settle(run.tokens_used)

        try:
            await cancel_on_disconnect(raw_request, run.start(self.ctx.admission))
        except BaseException:
            await finish()
            raise
        if stream:
            return EventStreamResponse(self._events(run, formatter), on_close=finish)
        try:
            choices = await cancel_on_disconnect(raw_request, run.collect())
        finally:
            await finish()
        return Response(formatter.response(choices, run).model_dump_json(), media_type="application/json")

    async def _events(self, run: GenerationRun, formatter: ResponseFormatter) -> AsyncIterator[str]:
        exclude = None if formatter.include_usage else {"usage"}
        try:
            for chunk in formatter.stream_prologue():
                yield sse_event(chunk, exclude)
            async for delta in run.deltas():
                for chunk in formatter.stream_chunks(delta, run):
                    yield sse_event(chunk, exclude)
            if formatter.include_usage:
                yield sse_event(formatter.usage_chunk(run.usage()))
        except Exception as exc:
            if not isinstance(exc, APIError):
                logger.exception("generation stream %s failed", run.request_ids[0])
            err = api_error_from(exc)
            yield sse_event(error_body(err.message, err.type, err.param, err.code))
        finally:
            await run.close()
        yield DONE_EVENT
