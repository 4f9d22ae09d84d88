"""One API request's prompts running on the connector, merged into one stream of choice deltas.

Chat and text completions both run their prompts through
:class:`GenerationRun`: it submits them (after admission control), merges
their output streams, enforces the queue and request timeouts, counts usage
and aborts whatever has not finished when it closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

import anyio

from servelm.api.admission import QUEUE_RETRY_AFTER_S, Admission, sequences_asked
from servelm.api.errors import APIError, RequestTimedOut, ServerOverloaded, api_error_from, with_param_renamed
from servelm.api.metrics import Metrics, RequestRecorder
from servelm.api.ratelimit import retry_after
from servelm.api.responses import CompletionTokensDetails, PromptTokensDetails, Usage
from servelm.connectors.base import Connector, ConnectorError
from servelm.engine.outputs import PositionLogprobs, RequestOutput, ToolCallDelta, merge_tool_calls
from servelm.engine.sampling_params import SamplingParams

logger = logging.getLogger("servelm.api")

T = TypeVar("T")


@dataclass
class ChoiceDelta:
    """What one engine step added to one choice, with the choice's API-wide index."""

    index: int
    prompt_index: int
    text: str
    num_tokens: int
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # pieces of the choice's tool calls


@dataclass
class ChoiceResult:
    """One choice of a finished, non-streamed request."""

    index: int
    prompt_index: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # whole calls, in order


class EngineRequestError(APIError):
    """The engine failed a request it had admitted (``RequestOutput.error``)."""

    def __init__(self, detail: str):
        super().__init__(f"The engine failed the request: {detail}", status=500, code="engine_error")


class GenerationRun:
    """One API request's prompts running on the connector, as one stream of choice deltas.

    Prompt ``i`` runs as engine request ``{request_id}-{i}`` (just
    ``request_id`` when there is one prompt); its choice ``c`` is API
    choice ``i * n + c``, as OpenAI numbers them. :meth:`start` waits for
    every prompt's first output so admission errors (context too long,
    unknown model) surface before a response is chosen. :meth:`close` aborts
    whatever has not finished; it is idempotent. ``max_model_len`` bounds
    the completion when ``params.max_tokens`` is None (for
    :attr:`max_total_tokens`). ``param_names`` maps the engine's names of
    parameters to the request fields the client set (structured outputs), so
    the connector's errors name the client's field.
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
        param_names: dict[str, str] | None = None,
    ):
        self.connector = connector
        self.model = model
        self.prompts = prompts
        self.params = params
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.param_names = param_names or {}
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
            completion_tokens_details=CompletionTokensDetails(),
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
            # tasks, so the limit is approximate for batches.
            # The run waits as one sequence per prompt and choice (best_of of them).
            asks = sequences_asked(len(self.prompts), self.params.best_of or self.params.n, admission.max_waiting)
            depth = await self.connector.queue_depth()
            if depth.waiting + asks > admission.max_waiting:
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
        except ConnectorError as exc:
            await self.close()
            if exc.param in self.param_names:
                raise with_param_renamed(api_error_from(exc), self.param_names) from None
            raise
        except BaseException:
            await self.close()
            raise
        self.admitted = True
        self.metrics.prompt_tokens.labels(self.model).inc(self.prompt_tokens)

    def _overloaded(self, code: str, message: str) -> ServerOverloaded:
        """The 429 for a refusal by admission control, counted in the metrics by ``code``."""
        self.metrics.admission_rejections.labels(code).inc()
        return ServerOverloaded(message, code=code, retry_after_s=retry_after(QUEUE_RETRY_AFTER_S))

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
                if out.error_code:  # the request's own error, found as it ran
                    raise APIError(out.error, status=400, code=out.error_code)
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
                    tool_calls=c.tool_calls,
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
            merge_tool_calls(r.tool_calls, d.tool_calls)
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
                with contextlib.suppress(BaseException):
                    await task
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
