"""A deterministic in-memory Connector for API tests: no model, no torch.

Tokens are UTF-8 bytes offset by 3 (ids 0..2 are special: PAD, BOS, EOS),
so tokenize/detokenize round-trip and counts are easy to predict. Each
choice ``i`` of a request replies with ``reply(i)`` one token per engine
step; all choices advance together, so n > 1 outputs interleave by index.
Knobs let a test script errors, pauses and exact output streams, and the
fake records every call (``generate_calls``, ``aborted``, ``template_calls``).
With ``params.tool_call_parser`` set, each choice's text goes through that
(pure) tool-call parser, as the engine's output processor does.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from servelm.connectors.base import (
    ConnectorError,
    ContextLengthExceeded,
    ModelCard,
    ModelNotFound,
    QueueDepth,
    ReplicaStatus,
)
from servelm.engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EngineStats,
    PositionLogprobs,
    RequestOutput,
    TokenLogprob,
)
from servelm.engine.sampling_params import SamplingParams, SamplingParamsError
from servelm.engine.tool_parsers import get_format

BOS, EOS, OFFSET = 1, 2, 3
QUEUE_TIME = 0.25  # what every output reports as the request's queue time
VOCAB_SIZE = 256 + OFFSET
CHAT_MODEL = "fake-chat"
EMBED_MODEL = "fake-embed"
EMBED_DIM = 4


def encode(text: str, add_special_tokens: bool = True) -> list[int]:
    """The fake tokenizer: one token per UTF-8 byte, BOS first when asked."""
    ids = [b + OFFSET for b in text.encode("utf-8")]
    return [BOS, *ids] if add_special_tokens else ids


def decode(ids: list[int]) -> str:
    """Inverse of :func:`encode`; special tokens decode to nothing."""
    return bytes(i - OFFSET for i in ids if i >= OFFSET).decode("utf-8", errors="replace")


def check_ids(ids: list[int], param: str) -> None:
    """What a real connector must do too: out-of-vocabulary ids are the client's error."""
    bad = [i for i in ids if not 0 <= i < VOCAB_SIZE]
    if bad:
        raise ConnectorError(f"token id {bad[0]} is out of the vocabulary (size {VOCAB_SIZE})", param=param)


def token_bytes(token_id: int) -> bytes:
    """A single token's bytes (special tokens have names)."""
    special = {0: "<pad>", BOS: "<s>", EOS: "</s>"}.get(token_id)
    return special.encode() if special is not None else bytes([token_id - OFFSET])


def position_logprobs(token_id: int, k: int) -> PositionLogprobs:
    """Made-up logprobs: the chosen token at -0.5, then k alternatives at -1, -2, ..."""
    top = [TokenLogprob(token_id, -0.5, token_bytes(token_id))]
    alt = [TokenLogprob(OFFSET + ord("a") + j, -1.0 - j, chr(ord("a") + j).encode()) for j in range(max(k - 1, 0))]
    return PositionLogprobs(chosen=TokenLogprob(token_id, -0.5, token_bytes(token_id)), top=(top + alt)[:k])


@dataclass
class FakeConnector:
    """Implements servelm.connectors.base.Connector in memory."""

    reply_text: str = "Hello world"
    max_model_len: int = 256
    healthy: bool = True
    fatal: str | None = None  # what fatal_error() reports
    # knobs
    script: list[RequestOutput] | None = None  # emitted verbatim instead of generating
    error_after: int | None = None  # emit RequestOutput.error after this many outputs
    raise_after: int | None = None  # raise RuntimeError after this many outputs
    raise_on_start: Exception | None = None  # raised before the first output
    hold_after: int | None = None  # wait on `release` after this many outputs
    release: asyncio.Event = field(default_factory=asyncio.Event)
    embed_dim: int = EMBED_DIM
    template_error: Exception | None = None
    hold_before_first: bool = False  # wait on `release` before the first output (a queued request)
    replica_statuses: list[ReplicaStatus] = field(default_factory=list)  # what replicas() reports
    running: int = 0  # what queue_depth() reports
    waiting: int = 0
    # records
    generate_calls: list[tuple[str, str, Any, SamplingParams]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    template_calls: list[dict[str, Any]] = field(default_factory=list)
    embed_calls: list[list[Any]] = field(default_factory=list)
    held: asyncio.Event = field(default_factory=asyncio.Event)  # set when a stream is held

    def reply(self, index: int) -> str:
        """The text choice ``index`` generates."""
        return self.reply_text if index == 0 else f"{self.reply_text} {index}"

    def _card(self, model: str, kind: str | None = None) -> ModelCard:
        for card in self._cards():
            if card.id == model:
                if kind is not None and card.kind != kind:
                    raise ConnectorError(f"{model} cannot do that", status=400, param="model")
                return card
        raise ModelNotFound(model)

    def _cards(self) -> list[ModelCard]:
        return [
            ModelCard(
                CHAT_MODEL,
                "generate",
                self.max_model_len,
                created=1700000000,
                root="/models/fake-chat.gguf",
                tool_call_parser="hermes",
            ),
            ModelCard(EMBED_MODEL, "embed", 32, created=1700000000, root="/models/fake-embed"),
        ]

    async def models(self) -> list[ModelCard]:
        return self._cards()

    async def health(self) -> bool:
        return self.healthy

    async def fatal_error(self) -> str | None:
        return self.fatal

    async def engine_stats(self) -> list[EngineStats]:
        return [EngineStats(CHAT_MODEL, num_running=self.running, num_waiting=self.waiting)]

    def generate(
        self, model: str, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        self.generate_calls.append((model, request_id, prompt, params))
        return self._generate(model, request_id, prompt, params)

    async def _generate(
        self, model: str, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        self._card(model, "generate")
        if self.raise_on_start is not None:
            raise self.raise_on_start
        prompt_ids = encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_ids(prompt_ids, "prompt")
        try:
            params.check_vocab(VOCAB_SIZE)  # as the local connector's engine does
        except SamplingParamsError as exc:
            raise ConnectorError(str(exc), param=exc.param) from None
        budget = self.max_model_len - len(prompt_ids)
        if params.max_tokens is not None and len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens (engine check).", param="prompt"
            )
        if self.hold_before_first:
            self.held.set()
            await self.release.wait()
        if self.script is not None:
            for out in self.script:
                yield out
            return
        max_tokens = params.max_tokens if params.max_tokens is not None else budget
        replies = [encode(self.reply(i), add_special_tokens=False) for i in range(params.n)]
        stops = [len(r) <= max_tokens for r in replies]
        lengths = [min(len(r), max_tokens) for r in replies]
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [position_logprobs(t, params.prompt_logprobs) for t in prompt_ids[1:]]
        parsers = (
            [get_format(params.tool_call_parser).parser() for _ in range(params.n)] if params.tool_call_parser else []
        )
        generated = 0
        step = 0
        while True:
            outputs = []
            for i in range(params.n):
                if step >= lengths[i]:
                    continue
                tok = replies[i][step]
                done = step == lengths[i] - 1
                text, tool_calls = token_bytes(tok).decode("utf-8", errors="replace"), []
                if parsers:
                    pieces = [parsers[i].feed(text), *([parsers[i].finish()] if done else [])]
                    text = "".join(p.content for p in pieces)
                    tool_calls = [c for p in pieces for c in p.tool_calls]
                outputs.append(
                    CompletionOutput(
                        index=i,
                        text=text,
                        token_ids=[tok],
                        logprobs=[position_logprobs(tok, params.logprobs)] if params.logprobs is not None else None,
                        finish_reason=("stop" if stops[i] else "length") if done else None,
                        tool_calls=tool_calls,
                    )
                )
            generated += len(outputs)
            step += 1
            finished = step >= max(lengths)
            if self.error_after is not None and step > self.error_after:
                yield RequestOutput(request_id, None, prompt_ids, [], finished=True, delta=True, error="boom")
                return
            if self.raise_after is not None and step > self.raise_after:
                raise RuntimeError("engine exploded")
            yield RequestOutput(
                request_id,
                prompt if isinstance(prompt, str) else None,
                prompt_ids,
                outputs,
                finished=finished,
                delta=True,
                prompt_logprobs=prompt_logprobs if step == 1 else None,
                num_cached_tokens=2 if step == 1 else 0,
                num_generated_tokens=generated,
                queue_time=QUEUE_TIME,
            )
            if finished:
                return
            if self.hold_after is not None and step >= self.hold_after:
                self.held.set()
                await self.release.wait()

    async def abort(self, model: str, request_id: str) -> None:
        self.aborted.append(request_id)

    async def queue_depth(self) -> QueueDepth:
        return QueueDepth(running=self.running, waiting=self.waiting)

    async def replicas(self) -> list[ReplicaStatus]:
        return self.replica_statuses

    async def embed(self, model: str, inputs: list[str] | list[list[int]]) -> list[EmbeddingOutput]:
        card = self._card(model, "embed")
        self.embed_calls.append(list(inputs))
        out = []
        for item in inputs:
            ids = encode(item) if isinstance(item, str) else list(item)
            check_ids(ids, "input")
            if len(ids) > card.max_model_len:
                raise ContextLengthExceeded("input too long (engine check)", param="input")
            raw = [float(len(ids) + j) for j in range(self.embed_dim)]
            norm = math.sqrt(sum(x * x for x in raw))
            out.append(EmbeddingOutput([x / norm for x in raw], len(ids)))
        return out

    async def tokenize(self, model: str, text: str, add_special_tokens: bool = True) -> list[int]:
        self._card(model)
        return encode(text, add_special_tokens)

    async def detokenize(self, model: str, token_ids: list[int]) -> str:
        self._card(model)
        check_ids(token_ids, "tokens")
        return decode(token_ids)

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
        self._card(model, "generate")
        self.template_calls.append(
            {
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "chat_template": chat_template,
                "tools": tools,
                "tool_call_parser": tool_call_parser,
                **kwargs,
            }
        )
        if self.template_error is not None:
            raise self.template_error
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")
