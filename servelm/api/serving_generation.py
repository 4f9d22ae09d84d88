"""Generation shared by chat and text completions: running prompts on the
connector, merging their streams, SSE framing, non-streamed collection,
usage and logprob formatting.

The endpoint handlers differ only in the JSON they build; they plug a
:class:`ResponseFormatter` into :meth:`GenerationServing.respond`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import anyio
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from servelm.api.access_log import request_record
from servelm.api.errors import APIError, RequestTimedOut, ServerOverloaded, api_error_from, error_body
from servelm.api.metrics import Metrics, RequestRecorder
from servelm.api.protocol import (
    ChatLogprobEntry,
    ChatLogprobTop,
    CompletionLogprobs,
    PromptTokensDetails,
    Usage,
)
from servelm.api.ratelimit import rate_limit_ticket, retry_after
from servelm.api.serving_engine import OpenAIServing, cancel_on_disconnect
from servelm.api.sse import DONE_EVENT, EventStreamResponse, sse_event
from servelm.connectors.base import Connector, ConnectorError
from servelm.engine.outputs import PositionLogprobs, RequestOutput
from servelm.engine.sampling_params import SamplingParams

logger = logging.getLogger("servelm.api")

T = TypeVar("T")

# JSON has no -inf; OpenAI-compatible servers report impossible tokens like this.
_MIN_LOGPROB = -9999.0


@dataclass
class ChoiceDelta:
    """What one engine step added to one choice, with the choice's API-wide index."""

    index: int
    prompt_index: int
    text: str
    num_tokens: int
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None


@dataclass
class ChoiceResult:
    """One choice of a finished, non-streamed request."""

    index: int
    prompt_index: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None


class EngineRequestError(APIError):
    """The engine failed a request it had admitted (``RequestOutput.error``)."""

    def __init__(self, detail: str):
        super().__init__(f"The engine failed the request: {detail}", status=500, code="engine_error")


@dataclass(frozen=True)
class Admission:
    """Admission control of generation requests (settings ``max_waiting``,
    ``queue_timeout``, ``request_timeout``; None: no limit).

    ``max_waiting``: a new request is refused (429 ``queue_full``) while that
    many engine requests already wait to start. ``queue_timeout``: seconds a
    request may wait for its first output before it is aborted and answered
    429 ``queue_timeout``. ``request_timeout``: seconds a whole request may
    run before it is aborted and answered 408 ``request_timeout`` (an error
    event then ``[DONE]`` once a stream has begun).
    """

    max_waiting: int | None = None
    queue_timeout: float | None = None
    request_timeout: float | None = None


# The attribute of ``app.state`` holding the app's Admission (set by create_app).
ADMISSION_STATE = "servelm_admission"

# Retry-After of a 429 for a full queue: engine steps take milliseconds to a
# second, so the queue moves within a second or two; clients back off from there.
_RETRY_AFTER_S = 1.0


def admission_for(request: Request) -> Admission:
    """The admission settings of the app serving ``request`` (no limits if none were set)."""
    return getattr(request.app.state, ADMISSION_STATE, None) or Admission()


class GenerationRun:
    """One API request's prompts running on the connector, as one stream of choice deltas.

    Prompt ``i`` runs as engine request ``{request_id}-{i}`` (just
    ``request_id`` when there is one prompt); its choice ``c`` is API
    choice ``i * n + c``, as OpenAI numbers them. :meth:`start` waits for
    every prompt's first output so admission errors (context too long,
    unknown model) surface before a response is chosen. :meth:`close` aborts
    whatever has not finished; it is idempotent. ``max_model_len`` bounds
    the completion when ``params.max_tokens`` is None (for
    :attr:`max_total_tokens`).
    """

    def __init__(
        self,
        connector: Connector,
        model: str,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        metrics: Metrics,
        *,
        max_model_len: int | None = None,
    ):
        self.connector = connector
        self.model = model
        self.prompts = prompts
        self.params = params
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.admitted = False  # the engine took every prompt (start() returned)
        self.received_at = time.perf_counter()  # when the API got the request (respond() sets the exact time)
        self.first_token_at: float | None = None  # time.perf_counter() at the first generated token
        self.request_ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        self.prompt_logprobs: list[list[PositionLogprobs | None] | None] = [None] * len(prompts)
        self.cached_tokens = [0] * len(prompts)
        self.completion_tokens = 0
        self._finished = [False] * len(prompts)
        self._buffer: list[tuple[int, RequestOutput]] = []
        self._iterators: list[AsyncIterator[RequestOutput]] = []
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        self._closed = False
        self._deadline: float | None = None  # loop time when request_timeout expires
        self._request_timeout = 0.0
        self._timeout: asyncio.Timeout | None = None  # the wait in progress, if any
        self._interrupted: BaseException | None = None
        self._recorders: list[RequestRecorder] = []

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def max_total_tokens(self) -> int:
        """The most tokens the run can use: every prompt, plus ``max_tokens`` for each sequence sampled."""
        total = 0
        for prompt in self.prompts:
            completion = self.params.max_tokens
            if completion is None:
                completion = max((self.max_model_len or len(prompt)) - len(prompt), 0)
            total += len(prompt) + (self.params.best_of or self.params.n) * completion
        return total

    @property
    def tokens_used(self) -> int:
        """Tokens the run used: prompts and completions, or none if the engine refused it."""
        return self.prompt_tokens + self.completion_tokens if self.admitted else 0

    def usage(self) -> Usage:
        """Token usage so far (all of it once the run is over)."""
        cached = sum(self.cached_tokens)
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    async def start(self, admission: Admission | None = None) -> None:
        """Submit every prompt and wait for each one's first output.

        With ``admission``, first refuse the run with :class:`ServerOverloaded`
        (429 ``queue_full``) if the engine's waiting queue is full, bound the
        wait for the first outputs by ``queue_timeout`` (429
        ``queue_timeout``) and the whole run by ``request_timeout``
        (:class:`RequestTimedOut`, also enforced by :meth:`deltas`). Raises
        the connector's error (e.g. ContextLengthExceeded) after aborting the
        prompts already submitted.
        """
        admission = admission or Admission()
        if admission.max_waiting is not None:
            # For a single prompt nothing between this check and the
            # submission below suspends (queue_depth and the local
            # connector's submission do not), so concurrent requests cannot
            # all slip past the limit. A batch of prompts is submitted from
            # tasks and counts as one request here: the limit is approximate.
            depth = await self.connector.queue_depth()
            if depth.waiting >= admission.max_waiting:
                raise self._overloaded(
                    "queue_full",
                    f"The server is at capacity: {depth.waiting} requests are already waiting. "
                    "Retry after the time in the Retry-After header.",
                )
        loop = asyncio.get_running_loop()
        now = loop.time()
        if admission.request_timeout is not None:
            self._deadline = now + admission.request_timeout
            self._request_timeout = admission.request_timeout
        first_deadline = self._deadline
        queue_deadline = None if admission.queue_timeout is None else now + admission.queue_timeout
        if queue_deadline is not None and (first_deadline is None or queue_deadline < first_deadline):
            first_deadline = queue_deadline
        self._started = True
        self._recorders = [RequestRecorder(self.metrics, self.model, len(p), self.received_at) for p in self.prompts]
        try:
            timeout = self._timeout = asyncio.timeout_at(first_deadline if self._interrupted is None else 0.0)
            try:
                async with timeout:
                    await self._first_outputs()
            except TimeoutError:
                if not timeout.expired():
                    raise
                # The prompts not yet answered keep _finished False, so
                # close() (below) aborts them in the engine.
                if self._interrupted is not None:
                    raise self._interrupted from None
                if first_deadline == queue_deadline:
                    raise self._overloaded(
                        "queue_timeout",
                        f"The request waited {admission.queue_timeout:g} s in the server's queue without "
                        "starting; the server is at capacity. Retry after the time in the Retry-After header.",
                    ) from None
                raise RequestTimedOut(self._request_timeout) from None
            finally:
                self._timeout = None
        except BaseException:
            await self.close()
            raise
        self.admitted = True
        self.metrics.prompt_tokens.labels(self.model).inc(self.prompt_tokens)

    def _overloaded(self, code: str, message: str) -> ServerOverloaded:
        """The 429 for a refusal by admission control, counted in the metrics by ``code``."""
        self.metrics.admission_rejections.labels(code).inc()
        return ServerOverloaded(message, code=code, retry_after_s=retry_after(_RETRY_AFTER_S))

    async def _first_outputs(self) -> None:
        if len(self.prompts) == 1:
            try:
                iterator = self.connector.generate(self.model, self.request_ids[0], self.prompts[0], self.params)
                self._iterators.append(iterator)
                first = await iterator.__anext__()
            except StopAsyncIteration:
                self._finished[0] = True
                raise EngineRequestError("the output stream ended before any output") from None
            except asyncio.CancelledError:
                raise  # a timeout or a disconnect: the request may be queued, so close() aborts it
            except Exception:
                self._finished[0] = True  # refused by the connector: nothing to abort
                raise
            self._buffer.append((0, first))
            return
        self._queue = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._pump(i)) for i in range(len(self.prompts))]
        waiting = set(range(len(self.prompts)))
        while waiting:
            i, item = await self._queue.get()
            if isinstance(item, BaseException) or item is None:
                self._finished[i] = True
            if isinstance(item, BaseException):
                raise item
            if item is None:
                if i in waiting:
                    raise EngineRequestError("the output stream ended before any output")
                continue
            self._buffer.append((i, item))
            waiting.discard(i)

    async def _pump(self, i: int) -> None:
        # One task per prompt: the prompts' streams are consumed concurrently
        # and merged through the queue in arrival order.
        assert self._queue is not None
        try:
            async for out in self.connector.generate(self.model, self.request_ids[i], self.prompts[i], self.params):
                self._queue.put_nowait((i, out))
            self._queue.put_nowait((i, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._queue.put_nowait((i, exc))

    async def _outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._buffer:
            yield self._buffer.pop(0)
        if self._queue is None:
            if not self._finished[0]:
                while True:
                    try:
                        out = await self._next(self._iterators[0].__anext__())
                    except StopAsyncIteration:
                        return
                    yield 0, out
            return
        while not all(self._finished):
            i, item = await self._next(self._queue.get())
            if isinstance(item, BaseException):
                self._finished[i] = True
                self._recorders[i].end("error")
                raise item
            if item is None:
                self._finished[i] = True  # ended without finished=True: take it as done
                self._recorders[i].end()
                continue
            yield i, item

    async def _next(self, awaitable: Awaitable[T]) -> T:
        # Each fetch gets the time left before the request timeout, rather
        # than one timeout around the generator, so the cancellation never
        # lands while the consumer (the response writer) holds control.
        deadline = self._deadline if self._interrupted is None else 0.0
        timeout = self._timeout = asyncio.timeout_at(deadline)
        try:
            async with timeout:
                return await awaitable
        except TimeoutError:
            if timeout.expired():
                # Unfinished prompts keep _finished False: close() aborts them.
                if self._interrupted is not None:
                    raise self._interrupted from None
                raise RequestTimedOut(self._request_timeout) from None
            raise
        finally:
            self._timeout = None

    def interrupt(self, exc: BaseException) -> None:
        """End the run with ``exc`` at its current (or next) wait for output (server shutdown).

        The prompts still running are aborted by :meth:`close` as after a timeout.
        """
        self._interrupted = exc
        if self._timeout is not None:
            self._timeout.reschedule(asyncio.get_running_loop().time())

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """The choices' deltas as they arrive; raises EngineRequestError on an engine failure."""
        n = self.params.n
        async for i, out in self._outputs():
            recorder = self._recorders[i]
            if out.error:
                self._finished[i] = True
                recorder.end("error")
                raise EngineRequestError(out.error)
            if out.prompt_logprobs is not None and self.prompt_logprobs[i] is None:
                self.prompt_logprobs[i] = out.prompt_logprobs
            self.cached_tokens[i] = max(self.cached_tokens[i], out.num_cached_tokens)
            # Recorded before the chunks go out, so TTFT and ITL do not include the client's reading.
            new_tokens = sum(len(c.token_ids) for c in out.outputs)
            finish_reason = next((c.finish_reason for c in reversed(out.outputs) if c.finish_reason), None)
            recorder.output(new_tokens, out.queue_time, finish_reason)
            if new_tokens:
                if self.first_token_at is None:
                    self.first_token_at = time.perf_counter()
                self.completion_tokens += new_tokens
            for c in out.outputs:
                yield ChoiceDelta(
                    index=i * n + c.index,
                    prompt_index=i,
                    text=c.text,
                    num_tokens=len(c.token_ids),
                    logprobs=c.logprobs,
                    finish_reason=c.finish_reason,
                )
            if out.finished:
                self._finished[i] = True
                recorder.end()
        if self._queue is None:
            self._finished[0] = True
            self._recorders[0].end()

    async def collect(self) -> list[ChoiceResult]:
        """Run to the end and return every choice, ordered by index."""
        results: dict[int, ChoiceResult] = {}
        async for d in self.deltas():
            r = results.get(d.index)
            if r is None:
                r = results[d.index] = ChoiceResult(d.index, d.prompt_index)
            r.text += d.text
            r.num_tokens += d.num_tokens
            if d.logprobs is not None:
                r.logprobs = (r.logprobs or []) + list(d.logprobs)
            if d.finish_reason is not None:
                r.finish_reason = d.finish_reason
        for r in results.values():
            if r.finish_reason is None:
                r.finish_reason = "stop"
        return [results[k] for k in sorted(results)]

    async def close(self) -> None:
        """Abort every prompt that has not finished. Safe to call more than once."""
        if self._closed or not self._started:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                try:
                    await task
                except BaseException:
                    pass
            for iterator in self._iterators:
                aclose = getattr(iterator, "aclose", None)
                if aclose is not None:
                    try:
                        await aclose()
                    except Exception:
                        logger.exception("closing the output stream of %s failed", self.request_ids[0])
            for request_id, finished, recorder in zip(self.request_ids, self._finished, self._recorders):
                if not finished:
                    recorder.end("abort")
                    try:
                        await self.connector.abort(self.model, request_id)
                    except Exception:
                        logger.exception("aborting request %s failed", request_id)


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
            await cancel_on_disconnect(raw_request, run.start(admission_for(raw_request)))
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
            if not isinstance(exc, (APIError, ConnectorError)):
                logger.exception("generation stream %s failed", run.request_ids[0])
            err = api_error_from(exc)
            yield sse_event(error_body(err.message, err.type, err.param, err.code))
        finally:
            await run.close()
        yield DONE_EVENT


def clamp_logprob(value: float) -> float:
    """A JSON-safe logprob (no -inf or NaN)."""
    if math.isnan(value) or value < _MIN_LOGPROB:
        return _MIN_LOGPROB
    return value


def chat_logprobs(entries: list[PositionLogprobs]) -> list[ChatLogprobEntry]:
    """Logprobs in the chat format: token, logprob, UTF-8 bytes and the top alternatives."""
    return [
        ChatLogprobEntry(
            token=e.chosen.text,
            logprob=clamp_logprob(e.chosen.logprob),
            bytes=list(e.chosen.text.encode("utf-8")),
            top_logprobs=[
                ChatLogprobTop(token=t.text, logprob=clamp_logprob(t.logprob), bytes=list(t.text.encode("utf-8")))
                for t in e.top
            ],
        )
        for e in entries
    ]


def legacy_logprobs(
    entries: list[PositionLogprobs | None], text_offset: int, first_token_text: str = ""
) -> CompletionLogprobs:
    """Logprobs in the legacy completions format, offsets counted from ``text_offset``.

    A ``None`` entry (the first prompt token, which nothing predicts) gets a
    null logprob and null top_logprobs; its text is ``first_token_text``.
    """
    out = CompletionLogprobs()
    offset = text_offset
    for e in entries:
        if e is None:
            token = first_token_text
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            token = e.chosen.text
            out.token_logprobs.append(clamp_logprob(e.chosen.logprob))
            top = {t.text: clamp_logprob(t.logprob) for t in e.top}
            top.setdefault(token, clamp_logprob(e.chosen.logprob))
            out.top_logprobs.append(top)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
    return out
