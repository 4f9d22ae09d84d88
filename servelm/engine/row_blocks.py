"""Searches along each row of a ``[rows, vocab]`` tensor in two levels, for the sampler.

A pass over the whole row that keeps an index or a running sum (``max``,
``argmax``, ``cumsum``) costs several times more on CPU than a plain
reduction (``amax``, ``sum``): over 32 rows of a 150k vocabulary, a few
milliseconds a decoding step. So a row is reduced in blocks of ``BLOCK``
columns first, and only the one block that holds the answer is searched
with the costly operation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

BLOCK = 1024  # columns per block


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's largest value and the first index holding it, as ``x.max(dim=-1)`` gives them (NaN
    counting as largest): the block maxima, then the first block holding the row's largest, searched alone."""
    block = _per_block(x, lambda blocks: blocks.amax(dim=-1)).max(dim=-1).indices[:, None]
    values, within = _block_columns(x, block, float("-inf")).max(dim=-1)
    return values, block[:, 0] * BLOCK + within


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's first index whose running sum of ``probs`` exceeds ``u`` (``[rows, 1]``, in [0, 1)) times
    the row's total: the block sums find the block the target falls in, a running sum inside it the index.
    A zero-probability index is never the one found."""
    block_cdf = _per_block(probs, lambda blocks: blocks.sum(dim=-1)).cumsum(dim=-1)
    target = u * block_cdf[:, -1:]
    block = _first_above(block_cdf, target)
    target = target - torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    # Columns past the vocabulary (in the last, partial block) weigh nothing.
    within = _first_above(_block_columns(probs, block, 0.0).cumsum(dim=-1), target)
    # Clamped: rounding must never yield an index past the vocabulary.
    return (block * BLOCK + within)[:, 0].clamp_(max=probs.shape[1] - 1)


def _per_block(x: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``[rows, blocks]``: ``reduce`` (over the last dimension) of each row's blocks of ``BLOCK`` columns,
    the last block partial where the width is not a multiple."""
    rows, width = x.shape
    full = width - width % BLOCK
    reduced = reduce(x[:, :full].reshape(rows, full // BLOCK, BLOCK))
    return torch.cat([reduced, reduce(x[:, None, full:])], dim=1) if full < width else reduced


def _block_columns(x: torch.Tensor, block: torch.Tensor, fill: float) -> torch.Tensor:
    """``[rows, BLOCK]``: the columns of each row's block (``block``, ``[rows, 1]``), ``fill`` past the width."""
    columns = block * BLOCK + torch.arange(BLOCK, device=x.device)
    return torch.where(columns < x.shape[1], x.gather(1, columns.clamp(max=x.shape[1] - 1)), fill)


def _first_above(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Each row's first column whose running sum ``cdf`` exceeds ``target`` (``[rows, 1]``), as ``[rows, 1]``.

    The target is first held strictly below the row's total, so that the column found adds a non-zero
    amount: a banned token adds nothing to the sum and can never be the one.
    """
    total = cdf[:, -1:]
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
