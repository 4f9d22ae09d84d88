"""A grammar stand-in for sampler tests: a fixed set of allowed tokens, written as a bitmask row."""

from __future__ import annotations

import torch


class FixedTokenMask:
    """Allows the tokens where ``allowed`` (bool[vocab]) is True, whatever came before."""

    def __init__(self, allowed: torch.Tensor):
        self.allowed = allowed.bool().cpu()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bits = torch.zeros(bitmask.shape[1] * 32, dtype=torch.bool)
        bits[: len(self.allowed)] = self.allowed
        words = (bits.view(-1, 32).long() << torch.arange(32)).sum(dim=-1)
        words = torch.where(words >= 2**31, words - 2**32, words)  # bit 31 is int32's sign
        bitmask[row] = words.to(torch.int32)
