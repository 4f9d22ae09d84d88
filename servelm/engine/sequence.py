"""One sequence being generated: its tokens, its KV blocks and how far its cache is filled."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life: queued, holding KV blocks, or done."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(eq=False)
class Sequence:
    """The token stream of one completion (a request with ``n=2`` has two).

    ``token_ids`` holds the prompt followed by the tokens generated so far.
    ``num_computed_tokens`` counts the leading tokens whose K/V are in the
    cache; the scheduler advances it, the engine appends sampled tokens.
    In steady decode the last token (the one just sampled) is the only one
    not yet computed: computing it yields the logits for the next token.

    A sequence ends when it samples one of ``stop_token_ids`` (the client's
    ``stop_token_ids``; ``stop_reason`` names the token), one of
    ``eos_token_ids`` (the model's end of text, empty with ``ignore_eos``) or
    its ``max_tokens``th token (``finish_reason`` "length"): the scheduler
    checks these as it appends each token. Stop strings are found later, in
    the text, by the output processor.

    With speculative decoding a decode step may verify up to
    ``num_speculative_tokens`` proposed tokens after the last one (0: this
    sequence never speculates); the scheduler appends the accepted ones.
    ``num_draft_computed`` counts the leading tokens whose K/V the draft model
    holds (draft mode only); like ``num_computed_tokens`` it drops to 0 when
    the sequence loses its blocks.

    ``eq=False`` keeps identity semantics: two sequences with the same
    tokens are still two sequences (lists of them are searched by identity).
    """

    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int
    arrival_time: float = 0.0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    # False makes admission skip the prefix cache lookup, so every prompt
    # position is computed (prompt logprobs need the logits of each one).
    use_prefix_cache: bool = True
    num_speculative_tokens: int = 0
    num_draft_computed: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    eos_token_ids: frozenset[int] = frozenset()
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" once finished
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    def __post_init__(self) -> None:
        # A private copy: the engine may build several sequences (n > 1)
        # from one prompt list, and each grows on its own.
        self.token_ids = list(self.token_ids)
        if not 1 <= self.num_prompt_tokens <= len(self.token_ids):
            raise ValueError(f"num_prompt_tokens must be in [1, {len(self.token_ids)}], got {self.num_prompt_tokens}")

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        """Tokens sampled so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt (a copy)."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def generated_token_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        """The newest token: the input of the next decode step."""
        return self.token_ids[-1]

    @property
    def is_prefill(self) -> bool:
        """True while more than one token lacks K/V.

        A decode computes exactly one token, the last; anything more (a
        prompt chunk, a recompute after preemption) is a prefill.
        """
        return self.num_computed_tokens < len(self.token_ids) - 1

    @property
    def is_finished(self) -> bool:
        """True once the engine finished or aborted the sequence."""
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Add a sampled token; its K/V are computed by the next step."""
        self.token_ids.append(token_id)

    def truncate(self, num_generated: int) -> None:
        """Drop generated tokens past the first ``num_generated`` (a stop string inside a speculative run ends
        the sequence at its token, and the accepted tokens after it must go)."""
        del self.token_ids[self.num_prompt_tokens + num_generated :]

    def stop_for_token(self, token_id: int) -> tuple[str, int | None] | None:
        """(finish_reason, stop_reason) if appending ``token_id`` ends the sequence, else None."""
        if token_id in self.stop_token_ids:
            return "stop", token_id
        if token_id in self.eos_token_ids:
            return "stop", None
        if self.num_generated_tokens >= self.max_tokens:
            return "length", None
        return None
