"""The async engine: a background thread runs ``LLMEngine.step()`` in a loop.

asyncio callers submit requests and aborts through a locked inbox; each step's
outputs go back to the callers' event loops with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from servelm.engine.llm_engine import LLMEngine
from servelm.engine.off_loop import run_sized
from servelm.engine.outputs import RequestOutput
from servelm.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is listening
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLMEngine:
    """Serve many concurrent requests from asyncio on one engine thread."""

    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.5):
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        # (request id, prompt ids, prompt text, params, compiled grammar, arrival time)
        self._inbox: list[tuple[str, list[int], str | None, SamplingParams, Any, float]] = []
        self._aborts: list[str] = []
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self.dead_error: BaseException | None = None

    # -- lifecycle -----------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="servelm-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread; requests still running get an EngineDeadError."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    @property
    def num_pending(self) -> int:
        """Requests submitted but not yet handed to the engine (read without the lock: a snapshot)."""
        return len(self._inbox)

    def request_ids(self) -> set[str]:
        """The ids of the requests submitted and not yet ended: those its queue figures count."""
        with self._lock:
            return set(self._streams)

    # -- requests ------------------------------------------------------

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Stream delta outputs of one request; the last has ``finished=True``.

        Validation errors (prompt too long, empty, a structured-output spec
        that does not compile, ...) raise before the first output. Leaving
        the loop early (or being cancelled) aborts the request in the engine.
        """
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running: {self.dead_error!r}")
        # A long text prompt is tokenized in a worker thread (the engine's
        # tokenizer is safe to share); a token list is already bounded by the context.
        size = len(prompt) if isinstance(prompt, str) else 0
        token_ids = await run_sized(size, self.engine.prepare_prompt, prompt, params)
        grammar = await self._compile_grammar(params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already running")
            self._streams[request_id] = stream
            text = prompt if isinstance(prompt, str) else None
            self._inbox.append((request_id, token_ids, text, params, grammar, time.monotonic()))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def _compile_grammar(self, params: SamplingParams) -> Any:
        """The request's compiled grammar (None without one): from the cache, or compiled in a worker thread.

        Compiling before the request enters the engine keeps the engine loop
        stepping the other requests meanwhile.
        """
        spec = params.structured_outputs
        if spec is None:
            return None
        grammars = self.engine.grammars
        grammar = grammars.cached(spec)
        if grammar is None:
            grammar = await asyncio.to_thread(grammars.compile, spec)
        return grammar

    def abort(self, request_id: str) -> None:
        """Abort a request; the engine frees its KV blocks before its next step."""
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    # -- the loop thread -----------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
        except BaseException as exc:
            logger.exception("engine loop died")
            self.dead_error = exc
        finally:
            err = EngineDeadError(
                f"the engine stopped: {self.dead_error!r}" if self.dead_error else "the engine stopped"
            )
            with self._lock:
                streams = list(self._streams.items())
            for _rid, stream in streams:
                stream.put(err)

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for request_id, token_ids, prompt, params, grammar, arrival in inbox:
            try:
                self.engine.add_request(
                    request_id,
                    prompt if prompt is not None else token_ids,
                    params,
                    token_ids,
                    arrival_time=arrival,
                    grammar=grammar,
                )
            except Exception as exc:
                self._deliver(request_id, exc)
        for request_id in aborts:
            self.engine.abort_request(request_id)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(item)
