"""Rotary position embedding (rotate-half RoPE), with Llama 3's and linear frequency scaling."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from servelm.layers.native import kernels_taking


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` of RoPE, with ``scaling`` (HF's ``rope_scaling``) applied."""
    dim = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class Rope(NamedTuple):
    cos: torch.Tensor  # [T, 1, head_dim // 2] float32, for the tokens' positions
    sin: torch.Tensor
    table: torch.Tensor  # [max_positions, head_dim] float32: cos then sin (the native kernel reads it)
    positions: torch.Tensor  # [T] int64


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE from a float32 cos/sin table over every position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        self.init_cache()

    def init_cache(self, freq_factors: torch.Tensor | None = None) -> None:
        """(Re)build the table where it lives; ``freq_factors`` divide the frequencies (GGUF ``rope_freqs``).

        Built on the CPU whatever the default device, so that a model made on the
        meta device and then ``to_empty``'d can fill it in afterwards.
        """
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
            if freq_factors is not None:
                inv_freq = inv_freq / freq_factors.float().cpu()
            positions = torch.arange(self.max_positions, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)
            table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        device = self.cos_sin.device
        self.cos_sin = table if device.type == "meta" else table.to(device)

    def forward(self, positions: torch.Tensor) -> Rope:
        """The tokens' rotation, shared by every layer."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return Rope(cos, sin, self.cos_sin, positions)


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate ``[T, heads, head_dim]`` by (cos, sin), in float32 for accuracy at low precision."""
    cos, sin = rope.cos, rope.sin
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def split_and_rotate_qkv(
    qkv: torch.Tensor,
    rope: Rope,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    qk_norm: tuple[nn.Module, nn.Module] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v ``[T, heads, head_dim]`` of fused QKV rows ``[T, (heads + 2 * kv_heads) * head_dim]``,
    q and k rotated, after ``qk_norm`` (Qwen3's per-head norms of q and k) where given.

    The native kernel rotates q and k where they lie, side by side at the start
    of each row (``qkv`` is then rotated in place); elsewhere, or with a q/k
    norm between the projection and the rotation, ``apply_rope`` makes rotated
    copies.
    """
    num_tokens = qkv.shape[0]
    native = kernels_taking(qkv) if qk_norm is None else None
    if native:
        native.rope_(qkv, num_heads + num_kv_heads, head_dim, rope.table, rope.positions)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    if not native:
        if qk_norm is not None:
            q, k = qk_norm[0](q), qk_norm[1](k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
    return q, k, v
