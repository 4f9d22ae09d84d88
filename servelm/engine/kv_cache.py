"""The paged KV cache's tensors: one per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(0: keys, 1: values), in the model's dtype or, with ``kv_cache_dtype`` int8, int8 rows of ``head_dim + 4``
bytes (``layers.kv_int8``). The target model and a draft model each have theirs, in the same block layout.
On the CPU each sits on transparent huge pages (``platform.memory.huge_page_zeros``)."""

from __future__ import annotations

import torch

from servelm.layers import kv_int8
from servelm.models.config import ModelConfig
from servelm.platform.memory import huge_page_zeros


def kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for the ``kv_cache_dtype`` setting."""
    return torch.int8 if kv_cache_dtype == "int8" else model_dtype


def _row_shape(config: ModelConfig, dtype: torch.dtype) -> tuple[int, int]:
    row = kv_int8.row_bytes(config.head_dim) if dtype == torch.int8 else config.head_dim
    return config.num_key_value_heads, row


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all of ``config``'s layers."""
    heads, row = _row_shape(config, dtype)
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * heads * row * elem


def allocate_kv_caches(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer; on the CPU each on huge pages, where the kernel grants them."""
    shape = (2, num_blocks, block_size, *_row_shape(config, dtype))
    if device.type == "cpu":
        return [huge_page_zeros(shape, dtype) for _ in range(config.num_hidden_layers)]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
