"""The local connector: the engine (and the embedding encoder) in this process."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from servelm.connectors.base import (
    ConnectorError,
    ContextLengthExceeded,
    ModelCard,
    ModelNotFound,
    QueueDepth,
    ReplicaStatus,
)
from servelm.engine.config import EngineConfig
from servelm.engine.off_loop import run_sized, text_size
from servelm.engine.outputs import EmbeddingOutput, EngineStats, RequestOutput
from servelm.engine.sampling_params import SamplingParams, SamplingParamsError
from servelm.engine.tool_parsers import detect_format
from servelm.engine.vocabulary import vocabulary_error
from servelm.platform.threads import in_passing_thread

logger = logging.getLogger(__name__)


def _engine_dead(exc: Exception) -> ConnectorError:
    # The server exits on a dead engine; until then its requests get a 503.
    # Why it died is in the server log (the engine loop logs it), not for clients.
    return ConnectorError(
        "The engine is down; the server is exiting.", status=503, type="service_unavailable_error", code="engine_dead"
    )


class _EmbeddingCancelled(Exception):
    """Ends the thread of an embeddings request whose caller has gone (nobody receives it)."""


class TurnLock:
    """A lock handed to its waiters in the order they asked: the encoder's turns.

    Embeddings requests run their sub-batches one at a time through it, so a
    request that arrives while a big one runs is served between the big
    one's sub-batches. ``threading.Lock`` would not do that: a thread that
    releases it and asks again at once nearly always gets it back before a
    waiter wakes.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        self._waiters: deque[threading.Lock] = deque()

    @property
    def waiting(self) -> int:
        """How many threads wait for their turn."""
        return len(self._waiters)

    def __enter__(self) -> None:
        with self._mutex:
            if not self._held:
                self._held = True
                return
            waiter = threading.Lock()
            waiter.acquire()
            self._waiters.append(waiter)
        waiter.acquire()  # released by __exit__, which hands the lock over still held

    def __exit__(self, *exc_info: object) -> None:
        with self._mutex:
            if self._waiters:
                self._waiters.popleft().release()
            else:
                self._held = False


class LocalConnector:
    """Serve a decoder model and an optional embedding model from this process.

    Construction is cheap; :meth:`load` loads the weights and starts the
    engine thread (``health()`` is False until then).
    """

    def __init__(
        self,
        model: str | None,
        embedding_model: str | None,
        engine_config: EngineConfig | None = None,
        served_model_name: str | None = None,
    ):
        self.model = model
        self.embedding_model = embedding_model
        self.engine_config = engine_config or EngineConfig()
        self.served_model_name = served_model_name or model
        self.engine = None  # AsyncLLMEngine once loaded
        self.embedder = None  # EmbeddingEngine once loaded
        self._embed_turns = TurnLock()  # the encoder runs one sub-batch at a time
        self._loaded = False
        self._load_error: str | None = None
        self._created = int(time.time())

    # -- lifecycle -----------------------------------------------------

    def load(self, progress: Callable[[str], None] | None = None) -> None:
        """Load the models and start the engine loop (blocking).

        A failure is re-raised and also kept for :meth:`fatal_error`.
        """
        try:
            self._load(progress or logger.info)
        except Exception as exc:
            self._load_error = f"could not load the models: {exc}"
            raise

    def _load(self, say: Callable[[str], None]) -> None:
        if self.model is not None:
            from servelm.engine.async_engine import AsyncLLMEngine
            from servelm.engine.llm_engine import LLMEngine

            say(f"loading model {self.model} ...")
            t0 = time.monotonic()
            engine = LLMEngine(self.model, self.engine_config)
            self.engine = AsyncLLMEngine(engine)
            self.engine.start()
            runner = engine.runner
            say(
                f"loaded {self.model} in {time.monotonic() - t0:.1f}s on {runner.device} ({runner.dtype}), "
                f"context {engine.max_model_len} tokens, KV cache {runner.num_blocks * runner.block_size} tokens"
            )
        if self.embedding_model is not None:
            from servelm.engine.embedding_engine import EmbeddingEngine

            say(f"loading embedding model {self.embedding_model} ...")
            t0 = time.monotonic()
            self.embedder = EmbeddingEngine(self.embedding_model)
            say(f"loaded {self.embedding_model} in {time.monotonic() - t0:.1f}s")
        self._loaded = True

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()

    # -- lookup --------------------------------------------------------

    def _llm(self, model: str):
        if self.engine is None or model != self.served_model_name:
            raise ModelNotFound(model)
        return self.engine

    def _embedder(self, model: str):
        if not self._serves_embeddings(model):
            raise ModelNotFound(model)
        return self.embedder

    def _serves_embeddings(self, model: str) -> bool:
        return self.embedder is not None and model == self.embedding_model

    def _tokenizer_for(self, model: str):
        """The decoder's tokenizer (the embedding model's text goes through :attr:`embedder`)."""
        if self.engine is not None and model == self.served_model_name:
            return self.engine.engine.tokenizer
        raise ModelNotFound(model)

    # -- the protocol ----------------------------------------------------

    async def models(self) -> list[ModelCard]:
        cards = []
        if self.engine is not None:
            cards.append(
                ModelCard(
                    id=self.served_model_name,
                    kind="generate",
                    max_model_len=self.engine.engine.max_model_len,
                    created=self._created,
                    root=self.model,
                    tool_call_parser=detect_format(self.engine.engine.tokenizer.chat_template),
                )
            )
        if self.embedder is not None:
            cards.append(
                ModelCard(
                    id=self.embedding_model,
                    kind="embed",
                    max_model_len=self.embedder.max_model_len,
                    created=self._created,
                    root=self.embedding_model,
                )
            )
        return cards

    async def health(self) -> bool:
        if not self._loaded:
            return False
        return self.engine is None or self.engine.is_alive

    async def fatal_error(self) -> str | None:
        if self._load_error is not None:
            return self._load_error
        engine = self.engine
        if engine is not None and engine.dead_error is not None:
            return f"the engine loop died: {engine.dead_error!r}"
        return None

    async def engine_stats(self) -> list[EngineStats]:
        """The engine's figures, read without its lock (see :meth:`queue_depth`)."""
        if self.engine is None:
            return []
        return [self.engine.engine.stats(self.served_model_name)]

    async def generate(
        self, model: str, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        from servelm.engine.async_engine import EngineDeadError
        from servelm.engine.llm_engine import InvalidPromptError, PromptTooLongError

        engine = self._llm(model)
        try:
            stream = engine.generate(request_id, prompt, params)
            first = await stream.__anext__()
        except PromptTooLongError as exc:
            raise ContextLengthExceeded(str(exc), param="prompt") from None
        except SamplingParamsError as exc:
            raise ConnectorError(str(exc), param=exc.param, code=exc.code) from None
        except InvalidPromptError as exc:
            raise ConnectorError(str(exc), param="prompt") from None
        except EngineDeadError as exc:
            raise _engine_dead(exc) from None
        try:
            yield first
            async for out in stream:
                yield out
        except EngineDeadError as exc:
            raise _engine_dead(exc) from None
        finally:
            await stream.aclose()

    async def abort(self, model: str, request_id: str) -> None:
        self._llm(model).abort(request_id)

    async def queue_depth(self) -> QueueDepth:
        """Running and waiting sequences of the engine (zeros before :meth:`load`).

        Waiting counts the scheduler's waiting queue plus the requests still
        in the async engine's inbox (submitted, not yet seen by the engine
        thread). Sequences being prefilled count as running. The counts are
        read from the event-loop thread without the engine lock: each read
        is a single ``len()``, so the result is a consistent-enough snapshot
        for admission control, never a torn value, and taking the lock would
        make every request wait for an engine step.
        """
        engine = self.engine
        if engine is None:
            return QueueDepth()
        scheduler = engine.engine.scheduler
        inbox = engine.num_pending
        return QueueDepth(running=scheduler.num_running, waiting=scheduler.num_waiting + inbox)

    async def replicas(self) -> list[ReplicaStatus]:
        """This process as the one replica (none before :meth:`load`)."""
        engine = self.engine
        if not self._loaded:
            return []
        depth = await self.queue_depth()
        alive = engine is None or engine.is_alive
        usage = engine.engine.block_manager.usage if engine is not None else 0.0
        return [
            ReplicaStatus(
                replica="local",
                state="RUNNING" if alive else "DEAD",
                node="local",
                pid=os.getpid(),
                running=depth.running,
                waiting=depth.waiting,
                kv_cache_usage=usage,
            )
        ]

    async def embed(self, model: str, inputs: list[str] | list[list[int]]) -> list[EmbeddingOutput]:
        """Embeddings of ``inputs``, sub-batch by sub-batch, taking turns with other requests.

        A cancelled call (its client gone) stops its work before the next
        sub-batch: the thread can't be interrupted, but it asks at each turn.
        """
        embedder = self._embedder(model)
        cancelled = threading.Event()

        @contextmanager
        def turn() -> Iterator[None]:
            with self._embed_turns:
                if cancelled.is_set():
                    raise _EmbeddingCancelled
                yield

        from servelm.engine.embedding_engine import InputTooLongError

        try:
            # Not in asyncio's worker threads, which live on: see servelm/platform/threads.py.
            return await in_passing_thread(lambda: embedder.embed(inputs, batch_turn=turn), name="servelm-embed")
        except asyncio.CancelledError:
            cancelled.set()
            raise
        except InputTooLongError as exc:
            raise ContextLengthExceeded(str(exc), param="input") from None
        except ValueError as exc:
            raise ConnectorError(str(exc), param="input") from None

    # Tokenizing, detokenizing and rendering a big input run in a worker thread
    # (see servelm.engine.off_loop), so they never stall the event loop.

    async def tokenize(self, model: str, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._serves_embeddings(model):
            return await run_sized(len(text), self.embedder.tokenize, text, add_special_tokens=add_special_tokens)
        tokenizer = self._tokenizer_for(model)
        return await run_sized(len(text), tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def detokenize(self, model: str, token_ids: list[int]) -> str:
        if self._serves_embeddings(model):
            embedder = self.embedder
            vocab_size, decode = embedder.vocab_size, embedder.detokenize
        else:
            tokenizer = self._tokenizer_for(model)
            vocab_size = tokenizer.vocab_size
            decode = partial(tokenizer.decode, skip_special_tokens=False)

        def checked_decode() -> str:
            outside = vocabulary_error(token_ids, vocab_size)
            if outside is not None:
                raise ConnectorError(outside, param="tokens")
            return decode(token_ids)

        return await run_sized(len(token_ids), checked_decode)

    async def apply_chat_template(
        self,
        model: str,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_call_parser: str | None = None,
        **kwargs: Any,
    ) -> str:
        tokenizer = self._tokenizer_for(model)
        from jinja2 import TemplateError

        try:
            return await run_sized(
                text_size(messages) + text_size(kwargs) + text_size(tools),
                tokenizer.apply_chat_template,
                messages,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tools=tools,
                tool_call_parser=tool_call_parser,
                **kwargs,
            )
        except (ValueError, TemplateError) as exc:
            raise ConnectorError(str(exc), param="messages") from None
