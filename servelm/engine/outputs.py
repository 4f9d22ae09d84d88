"""What the engine hands back: plain dataclasses, no torch, safe to pickle.

The same types serve the offline API (cumulative: the whole completion so
far) and the async engine's stream (delta: only what is new since the last
output). ``RequestOutput.delta`` says which.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """The log-probability of one token, with the bytes it stands for."""

    token_id: int
    logprob: float
    token_bytes: bytes

    @property
    def text(self) -> str:
        """The token's text: its bytes as UTF-8, with the bytes of a character it holds only part of
        written as ``\\xNN`` escapes (so distinct tokens keep distinct texts)."""
        return self.token_bytes.decode("utf-8", errors="backslashreplace")


@dataclass
class PositionLogprobs:
    """Logprobs at one position: the chosen token and the top alternatives.

    ``top`` is sorted by logprob, highest first, and holds ``k`` entries
    (the request's ``logprobs``/``prompt_logprobs`` number).
    """

    chosen: TokenLogprob
    top: list[TokenLogprob] = field(default_factory=list)


@dataclass
class ToolCallDelta:
    """A piece of one tool call a choice made, as the tool-call parser read it from the text.

    ``index`` numbers the choice's calls from 0. The first piece of a call
    carries its function ``name`` (and usually empty ``arguments``); later
    pieces carry only more of the ``arguments`` JSON text. Pieces of one
    call, joined in order, give the whole call (see :func:`merge_tool_calls`).
    """

    index: int
    name: str | None = None
    arguments: str = ""


def merge_tool_calls(calls: list[ToolCallDelta], pieces: list[ToolCallDelta]) -> None:
    """Fold ``pieces`` into ``calls`` (one entry per call, in index order), in place."""
    for piece in pieces:
        if piece.index < len(calls):
            whole = calls[piece.index]
            whole.arguments += piece.arguments
            if piece.name is not None:
                whole.name = piece.name
        else:
            calls.append(ToolCallDelta(piece.index, piece.name, piece.arguments))


@dataclass
class CompletionOutput:
    """One choice of a request (a request with n=2 has two).

    With a tool-call parser (``SamplingParams.tool_call_parser``), ``text``
    is the content outside tool calls and ``tool_calls`` holds the calls.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after an engine step.

    ``outputs`` holds the choices that changed in this step when ``delta``
    is true, every choice otherwise. ``num_generated_tokens`` counts all
    generated tokens of all choices so far, whichever mode.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    delta: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # first entry None: nothing predicts token 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    error: str | None = None  # set when the request failed inside the engine
    error_code: str | None = None  # set when that was the request's own error: the API's code for it
    # Seconds from the engine receiving the request to its first scheduling
    # (None until then): the queue time of the request.
    queue_time: float | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine's state and running totals, for metrics.

    ``num_running``/``num_waiting`` count sequences; ``kv_cache_usage`` is the
    fraction of KV blocks held by sequences (free blocks kept for the prefix
    cache do not count); the prefix-cache figures count prompt tokens looked
    up and found since the engine started. ``dtype``, ``device`` and the KV
    cache's size (tokens, bytes) describe the engine and never change. The
    ``spec_decode_`` totals count speculative decoding's verified proposals,
    their proposed tokens and of those the accepted ones (the acceptance
    rate is accepted / draft tokens).
    """

    model: str
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    dtype: str = ""
    device: str = ""
    kv_cache_tokens: int = 0
    kv_cache_bytes: int = 0
    spec_decode_drafts: int = 0
    spec_decode_draft_tokens: int = 0
    spec_decode_accepted_tokens: int = 0
    replica: str | None = None  # which replica of a Ray deployment; None: this process, or a sum


@dataclass
class EmbeddingOutput:
    """One input's embedding."""

    embedding: list[float]
    num_tokens: int


def accumulate(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Fold a delta output into the cumulative output of the same request.

    ``total`` is None for the first delta. The result has ``delta=False`` and
    every choice seen so far, in index order.
    """
    if total is None:
        total = RequestOutput(
            request_id=delta.request_id,
            prompt=delta.prompt,
            prompt_token_ids=delta.prompt_token_ids,
            outputs=[],
        )
    choices = {c.index: c for c in total.outputs}
    for d in delta.outputs:
        c = choices.get(d.index)
        if c is None:
            c = choices[d.index] = CompletionOutput(index=d.index, logprobs=[] if d.logprobs is not None else None)
        c.text += d.text
        c.token_ids.extend(d.token_ids)
        if d.logprobs is not None and c.logprobs is not None:
            c.logprobs.extend(d.logprobs)
        merge_tool_calls(c.tool_calls, d.tool_calls)
        c.cumulative_logprob = d.cumulative_logprob
        c.finish_reason = d.finish_reason
        c.stop_reason = d.stop_reason
    total.outputs = [choices[i] for i in sorted(choices)]
    if delta.prompt_logprobs is not None:
        total.prompt_logprobs = delta.prompt_logprobs
    total.finished = delta.finished
    total.num_cached_tokens = delta.num_cached_tokens
    total.num_generated_tokens = delta.num_generated_tokens
    total.error = delta.error
    total.error_code = delta.error_code
    total.queue_time = delta.queue_time
    return total
