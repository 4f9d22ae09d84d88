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

    def __post_init__(self) -> None:
        # A private copy: the engine may build several sequences (n > 1)
        # from one prompt list, and each grows on its own.
        self.token_ids = list(self.token_ids)
        if not 1 <= self.num_prompt_tokens <= len(self.token_ids):
            raise ValueError(
                f"num_prompt_tokens must be in [1, {len(self.token_ids)}], got {self.num_prompt_tokens}"
            )

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
