"""The int8 KV cache (``--kv-cache-dtype int8``) in PyTorch: its row layout, rounding and reading back.

A row, one token's one KV head, is ``head_dim`` int8 values and then their
float32 scale in 4 more bytes: value d is ``row[d] * scale``, with ``scale =
max |x| / 127`` and each value rounded to the nearest multiple of it. So an
int8 cache tensor is ``[2, blocks, block_size, kv_heads, head_dim + 4]``
int8, about half a bfloat16 cache's bytes. servelm's CPU kernels
(``kernels/kv_int8.c``, ``paged_attention.c``) write and read it in place;
these functions are the same in PyTorch, for the other paths (CUDA, a
float32 model, CPUs without AVX512-BF16) and as the tests' reference.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # a float32 per row


def row_bytes(head_dim: int) -> int:
    """Bytes of one int8 row of ``head_dim`` values."""
    return head_dim + SCALE_BYTES


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` (any float dtype) as int8 rows ``[..., head_dim + 4]``."""
    x = x.float()
    top = x.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, 127.0 / top, torch.zeros_like(top))
    values = torch.round(x * inv).clamp_(-127, 127).to(torch.int8)
    scales = (top / 127.0).contiguous().view(torch.int8)  # the float32's 4 bytes
    return torch.cat([values, scales], -1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Int8 rows ``[..., head_dim + 4]`` back to ``[..., head_dim]`` values of ``dtype``."""
    scales = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :-SCALE_BYTES].float() * scales).to(dtype)
