"""A sequence's grammar as a logits processor: its matcher, and the batch's token bitmask.

Each constrained sequence holds a :class:`GrammarMatcher` over its compiled
grammar. The engine advances it with every token the sequence accepts
(never again on a recompute after preemption: the matcher's state is the
output's, not the KV cache's). Each step the sampler asks
:func:`mask_logits` to fill one bitmask row per constrained sequence and
apply them to the batch's logits at once, with tensor ops. Rows
without a grammar are neither filled nor masked; the one cost they share is
a copy of the batch's logits (the raw ones stay for logprobs), and a batch
without any constrained row skips even that.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
import xgrammar as xgr


class TokenBitmaskFiller(Protocol):
    """What the sampler needs from a constrained row: its allowed tokens, as one bitmask row."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (bit ``t % 32`` of word ``t // 32`` is token ``t``)."""
        ...


class GrammarMatcher:
    """One sequence's position in its grammar.

    ``stop_token_ids`` end the grammar: the bitmask allows them only where
    the grammar can end, and nothing else there once it must.
    """

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: Iterable[int]):
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_token_ids))
        self._vocab_size = compiled.tokenizer_info.vocab_size
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False (and no change) when the grammar does not allow it."""
        if not self._matcher.accept_token(token_id):
            return False
        self.num_accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative tokens, a retracted step)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} accepted tokens")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    @property
    def is_terminated(self) -> bool:
        """True once a stop token was accepted: the grammar allows nothing more."""
        return self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens the grammar allows next into ``bitmask[row]``."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def allows_nothing(self) -> bool:
        """A dead end: no next token, not even a stop token, fits the grammar (it can never be completed)."""
        bitmask = xgr.allocate_token_bitmask(1, self._vocab_size)
        self.fill_bitmask(bitmask, 0)
        return not bool(bitmask.any())


def mask_logits(logits: torch.Tensor, masks: Sequence[TokenBitmaskFiller | None]) -> torch.Tensor:
    """``logits`` with every token its row's mask disallows at -inf; ``logits`` itself when no row has one.

    ``masks[i]`` is row ``i``'s mask, or None for an unconstrained row. The
    result is a new tensor: the caller keeps the raw logits (for logprobs).
    """
    rows = [i for i, m in enumerate(masks) if m is not None]
    if not rows:
        return logits
    vocab = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
    for k, i in enumerate(rows):
        masks[i].fill_bitmask(bitmask, k)  # type: ignore[union-attr]
    # Unpacked with tensor ops (bit b of word w is token 32 w + b) rather than xgrammar's CPU kernel,
    # which walks the bits one by one and costs several times more when most of the vocabulary is masked.
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(len(rows), -1)[:, :vocab].to(logits.device)
    if len(rows) == logits.shape[0]:  # every row constrained: one pass, no copy to patch
        return torch.where(allowed, logits, float("-inf"))
    index = torch.tensor(rows, device=logits.device)
    masked = logits.clone()
    masked[index] = torch.where(allowed, logits[index], float("-inf"))
    return masked
