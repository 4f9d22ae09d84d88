"""Attention over the paged KV cache.

KV cache layout, one tensor per layer:
    [2, num_blocks, block_size, num_kv_heads, head_dim]   (0: keys, 1: values)
Token t of a sequence lives in block ``block_table[t // block_size]`` at
offset ``t % block_size``; its flat slot is ``block * block_size + offset``.
An int8 cache (``kv_int8``) holds each head's row as ``head_dim + 4`` bytes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from servelm import kernels
from servelm.layers.kv_int8 import dequantize_rows, quantize_rows


@dataclass
class AttentionMetadata:
    """Describes one flattened batch to the attention layers.

    Sequences are ordered prefills first (any query length, including chunks
    of a longer prompt and recomputes after preemption), then decodes (query
    length 1). The flattened token axis follows the same order.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot for each new token's K/V
    query_lens: list[int]  # per sequence: new tokens in this step
    context_lens: list[int]  # per sequence: tokens in the cache after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0 past each table's end
    num_prefills: int  # sequences [0, num_prefills) are prefills
    num_prefill_tokens: int  # tokens [0, num_prefill_tokens) belong to prefills
    # The decodes' context_lens as a tensor, made once per step so every layer reuses it:
    decode_lens: torch.Tensor | None = None  # [num_decodes] int64 on the device
    # Each prefix-cached prefill's attention mask, built by the first layer and reused by the rest:
    prefix_masks: dict[tuple[int, int, int, int], torch.Tensor] = field(default_factory=dict)
    # The prefills' first token rows, query lengths and context lengths for the native prefill kernel, likewise:
    prefill_lens: torch.Tensor | None = None  # [3, num_prefills] int64 on the CPU

    def prefill_seq_lens(self) -> torch.Tensor:
        """``prefill_lens``, built on first use."""
        if self.prefill_lens is None:
            query_lens = self.query_lens[: self.num_prefills]
            starts = list(itertools.accumulate(query_lens, initial=0))[:-1]
            self.prefill_lens = torch.tensor([starts, query_lens, self.context_lens[: self.num_prefills]])
        return self.prefill_lens


def write_kv_cache(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's keys and values ``[num_tokens, num_kv_heads, head_dim]`` at their slots."""
    native = kernels.for_cache(key, kv_cache)
    if native and key.stride()[1:] == (key.shape[2], 1) and value.stride() == key.stride():
        native.write_kv(kv_cache, key, value, slot_mapping)
        return
    if kv_cache.dtype == torch.int8:
        key, value = quantize_rows(key), quantize_rows(value)
    num_kv_heads, row = kv_cache.shape[-2:]
    # kv_cache[i] of a contiguous cache is contiguous, so the flat view aliases the cache.
    kv_cache[0].view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def gather_kv(
    kv_cache: torch.Tensor, block_tables: torch.Tensor, max_len: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the first ``max_len`` tokens of each block table, in ``dtype``.

    Two ``[num_seqs, max_len, kv_heads, head_dim]`` copies; positions past a
    sequence's own length hold whatever its padding blocks hold.
    """
    block_size = kv_cache.shape[2]
    num_blocks = -(-max_len // block_size)
    tables = block_tables[:, :num_blocks]
    shape = (tables.shape[0], num_blocks * block_size, *kv_cache.shape[-2:])
    # index_select over the flat block axis is a plain row copy, faster on CPU
    # than advanced indexing with a 2-D index.
    flat = tables.reshape(-1)
    keys = kv_cache[0].index_select(0, flat).view(shape)[:, :max_len]
    values = kv_cache[1].index_select(0, flat).view(shape)[:, :max_len]
    if kv_cache.dtype == torch.int8:
        return dequantize_rows(keys, dtype), dequantize_rows(values, dtype)
    return keys, values


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of one flattened batch over the paged cache.

    ``query`` is ``[num_tokens, num_heads, head_dim]``; ``key``/``value`` are this
    step's ``[num_tokens, num_kv_heads, head_dim]``, written into ``kv_cache``
    first. Returns ``[num_tokens, num_heads, head_dim]``.
    """
    write_kv_cache(kv_cache, key, value, meta.slot_mapping)
    if meta.num_prefills == 0:
        return _decode_attention(query, kv_cache, meta, scale)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    prefill_tokens = meta.num_prefill_tokens
    native = kernels.for_cache(query, kv_cache)
    tables = meta.block_tables[: meta.num_prefills]
    lens = meta.prefill_seq_lens() if native else None
    if not (native and native.prefill_attention(query[:prefill_tokens], kv_cache, tables, lens, scale, out)):
        _prefill_attention(query, key, value, kv_cache, meta, scale, out)
    if prefill_tokens < query.shape[0]:
        out[prefill_tokens:] = _decode_attention(query[prefill_tokens:], kv_cache, meta, scale)
    return out


def _prefill_attention(query, key, value, kv_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """PyTorch's path for the prefills' rows of ``out``: SDPA per sequence, over the fresh K/V or the gathered
    cache."""
    start = 0
    for i in range(meta.num_prefills):
        query_len, context_len = meta.query_lens[i], meta.context_lens[i]
        end = start + query_len
        if query_len == context_len:
            # Nothing cached before this chunk: attend to the fresh K/V, plain causal.
            out[start:end] = _causal_attention(query[start:end], key[start:end], value[start:end], scale)
        else:
            # Whole blocks: CPU SDPA runs up to 1.9x faster over a multiple of 16 keys than
            # over a few less. The last block's tail is masked out, and zeroed so that no
            # stale NaN there could leak in through a zero weight.
            padded_len = -(-context_len // kv_cache.shape[2]) * kv_cache.shape[2]
            keys, values = gather_kv(kv_cache, meta.block_tables[i : i + 1], padded_len, query.dtype)
            keys[:, context_len:] = 0
            values[:, context_len:] = 0
            group = query.shape[1] // kv_cache.shape[-2]
            shape = (query_len, context_len, padded_len, group)
            if shape not in meta.prefix_masks:
                meta.prefix_masks[shape] = _prefix_mask(*shape, query.dtype, query.device)
            mask = meta.prefix_masks[shape]
            out[start:end] = _grouped_attention(query[None, start:end], keys, values, mask, scale)[0]
        start = end


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal self-attention of one sequence; ``[len, heads, dim]`` in and out."""
    # 4-D inputs: the fused CUDA kernels (flash, which also takes enable_gqa) want a batch axis.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        is_causal=True,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


def _prefix_mask(
    query_len: int, context_len: int, padded_len: int, group: int, dtype: torch.dtype, device
) -> torch.Tensor:
    """The additive mask of a chunk of queries at the end of a ``context_len`` context, each seeing keys up
    to its own position, over ``padded_len`` keys, laid out for ``_grouped_attention``'s folded heads:
    ``[1, 1, group * query_len, padded_len]``, 0 where a query attends and -inf where it does not (SDPA
    would convert a boolean one on every call)."""
    query_pos = torch.arange(context_len - query_len, context_len, device=device)
    key_pos = torch.arange(padded_len, device=device)
    allowed = key_pos[None, :] <= query_pos[:, None]  # [query_len, padded_len]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
    return mask.repeat(group, 1)[None, None]


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query token per decode sequence.

    On CPU the native kernel reads the cache blocks in place; elsewhere (or
    where it could not be built, or does not take an int8 cache) the
    sequences' K/V are gathered and all of them go through one SDPA call.
    """
    context_lens = meta.context_lens[meta.num_prefills :]
    lens = meta.decode_lens
    if lens is None:
        lens = torch.tensor(context_lens, device=q.device)
    tables = meta.block_tables[meta.num_prefills :]
    native = kernels.for_cache(q, kv_cache)
    out = native.decode_attention(q, kv_cache, tables, lens, scale) if native else None
    if out is not None:
        return out
    mask = torch.arange(max(context_lens), device=q.device)[None, :] < lens[:, None]
    keys, values = gather_kv(kv_cache, tables, mask.shape[1], q.dtype)
    # A shorter sequence's keys past its length are stale slots: zeroed, so that a NaN
    # left there cannot leak in through its zero weight.
    stale = ~mask[:, :, None, None]
    keys, values = keys.masked_fill(stale, 0), values.masked_fill(stale, 0)
    # [batch, 1, 1, kv_len]: one query row per sequence, the same for every head
    return _grouped_attention(q[:, None], keys, values, mask[:, None, None], scale)[:, 0]


def _grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked GQA without copying K/V per query head.

    q ``[batch, q_len, heads, dim]``, k/v ``[batch, kv_len, kv_heads, dim]``,
    a mask broadcastable to the folded heads' scores ``[batch, kv_heads, group *
    q_len, kv_len]`` (boolean, True attends, or additive: ``_prefix_mask``).
    The query heads that share a KV head are folded into the query-length
    axis, so SDPA runs as plain multi-head attention over ``kv_heads``
    (memory-efficient kernels on CUDA take a mask but not ``enable_gqa``).
    """
    batch, q_len, num_heads, dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    # Head h reads KV head h // group, as in HF's repeat_kv.
    q = q.reshape(batch, q_len, num_kv_heads, group, dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(batch, num_kv_heads, group * q_len, dim)
    out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
    return out.view(batch, num_kv_heads, group, q_len, dim).permute(0, 3, 1, 2, 4).reshape(batch, q_len, num_heads, dim)
