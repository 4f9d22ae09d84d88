"""Searches along each row of a ``[rows, vocab]`` tensor in levels, for the sampler.

A pass over the whole row that keeps an index or a running sum (``max``,
``argmax``, ``cumsum``) costs several times more on CPU than a plain
reduction (``amax``, ``sum``): over 32 rows of a 150k vocabulary, a few
milliseconds a decoding step. So a row is reduced in blocks of ``BLOCK``
columns first, and only the one block that holds the answer is searched
with the costly operation. A sort costs far more again (tens of
milliseconds a row): ``mass_threshold`` finds a top-p cutoff from bucket
sums instead. The raw logprobs are never written out either:
``log_softmax_stats`` gives each row's largest value, its index and its
logsum, from which any logprob follows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from servelm import kernels

BLOCK = 1024  # columns per block


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's largest value and the first index holding it, as ``x.max(dim=-1)`` gives them (NaN
    counting as largest): the block maxima, then the first block holding the row's largest, searched alone."""
    block = _per_block(x, lambda blocks: blocks.amax(dim=-1)).max(dim=-1).indices[:, None]
    values, within = _block_columns(x, block, float("-inf")).max(dim=-1)
    return values, block[:, 0] * BLOCK + within


def row_kernels(x: torch.Tensor) -> kernels.CpuKernels | None:
    """The CPU kernels where they read ``x`` as float32 rows ``[rows, vocab]``, each contiguous (their
    passes over logits: ``log_softmax_stats``, the draw, ``top_values``); None elsewhere."""
    native = kernels.for_tensors(x)
    return native if native is not None and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1 else None


def log_softmax_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(largest, index, logsum)`` per row of float32 ``logits``, with ``log_softmax(logits) = logits -
    largest - logsum``: ``logits.max(dim=-1)`` (a NaN counts as largest) and ``log(sum(exp(logits -
    largest)))``, NaN where ``largest`` is not finite, as the log-softmax row then is.

    On CPU one pass of a native kernel, 2-3x faster than ``log_softmax`` over a 150k vocabulary, which
    also writes a result as large as the logits (bench/sampler_stats.py).
    """
    native = row_kernels(logits)
    if native is not None:
        return native.log_softmax_stats(logits)
    largest, index = row_max(logits)
    # logsumexp is inf, -inf or NaN where largest is not finite, and the difference then NaN.
    return largest, index, torch.logsumexp(logits, dim=-1) - largest


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


def mass_threshold(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Each row's largest value ``v`` such that the row's values of at least ``v`` sum to at least ``p``
    (``[rows, 1]``), as ``[rows, 1]``: the smallest probability top-p keeps, found without a sort.

    ``probs`` holds non-negative values, taken as float32, whose bits order as their values do; ``v``'s
    bits are found 11, 11, then 9 at a time. At each level the values whose higher bits match those found
    so far are summed into buckets by their next bits, and the highest bucket at which the mass from the
    top reaches ``p`` gives the next bits. The first level reads every value; the others only the few left
    in the bucket found. Where rounding leaves a row's total short of ``p``, the lowest bucket is taken,
    and every value is at least the result.
    """
    probs = probs.float().contiguous()
    rows = probs.shape[0]
    bits = probs.view(torch.int32)
    key = ((bits >> 20) & 2047).long()
    buckets = torch.zeros(rows, 2048, dtype=probs.dtype, device=probs.device).scatter_add_(1, key, probs)
    found, above = _highest_reaching(buckets, torch.zeros_like(buckets[:, :1]), p)
    row, column = (key == found).nonzero(as_tuple=True)
    bits, probs = bits[row, column], probs[row, column]
    found = found << 20
    for shift, width in ((9, 11), (0, 9)):
        key = ((bits >> shift) & ((1 << width) - 1)).long()
        buckets = torch.zeros(rows << width, dtype=probs.dtype, device=probs.device)
        buckets = buckets.scatter_add_(0, (row << width) + key, probs).view(rows, 1 << width)
        bucket, above = _highest_reaching(buckets, above, p)
        found = found | (bucket << shift)
        left = key == bucket[row, 0]
        row, bits, probs = row[left], bits[left], probs[left]
    return found.int().view(torch.float32)


def _highest_reaching(buckets: torch.Tensor, above: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's highest bucket (``[rows, 1]``) at which ``above`` (the mass above every bucket) plus the mass
    of the buckets from the top reaches ``p`` (the lowest where none does), and the mass above that bucket."""
    from_top = buckets.flip(1).cumsum(1).flip(1)  # at each bucket: its mass and the mass of those above it
    bucket = ((above + from_top) >= p).sum(dim=1, keepdim=True).clamp_(min=1) - 1
    return bucket, above + from_top.gather(1, bucket) - buckets.gather(1, bucket)


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
