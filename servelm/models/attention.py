"""Attention over the paged KV cache.

KV cache layout, one tensor per layer:
    [2, num_blocks, block_size, num_kv_heads, head_dim]   (0: keys, 1: values)
Token t of a sequence lives in block ``block_table[t // block_size]`` at
offset ``t % block_size``; its flat slot is ``block * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    # Decode part, precomputed once per step so every layer reuses it:
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64 on the device
