"""The paged KV cache's tensors: one per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(0: keys, 1: values). The target model and a draft model each have theirs, in the same block layout."""

from __future__ import annotations

import torch

from servelm.models.config import ModelConfig


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all of ``config``'s layers."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * elem


def allocate_kv_caches(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer."""
    shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
