"""Llama-family decoder in plain PyTorch: Llama, Mistral, Qwen2, Qwen3 (and SmolLM, a Llama).

One forward call takes one flattened batch of tokens from many sequences (no
padding) and reads/writes the paged KV cache through ``AttentionMetadata``.
Q/K/V and gate/up projections are fused into one matmul each; ``load_weights``
fuses the HF checkpoint's separate tensors as it copies them in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from servelm.models.attention import AttentionMetadata, paged_attention
from servelm.models.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like HF's LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` of RoPE, with the config's scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
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


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE from a float32 cos/sin table over every position."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        self.init_cache()

    def init_cache(self, freq_factors: torch.Tensor | None = None) -> None:
        """(Re)build the table where it lives; ``freq_factors`` divide the frequencies (GGUF ``rope_freqs``).

        Built on the CPU whatever the default device, so that a model made on the
        meta device and then ``to_empty``'d can fill it in afterwards.
        """
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(self.config)
            if freq_factors is not None:
                inv_freq = inv_freq / freq_factors.float().cpu()
            positions = torch.arange(self.config.max_position_embeddings, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)
            table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        device = self.cos_sin.device
        self.cos_sin = table if device.type == "meta" else table.to(device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) ``[T, 1, head_dim // 2]`` for the tokens' positions, shared by every layer."""
        return self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate ``[T, heads, head_dim]`` by (cos, sin), in float32 for accuracy at low precision."""
    cos, sin = rope
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Self-attention with fused QKV, GQA, optional QKV bias and per-head q/k norm."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias, dtype=dtype
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_out_bias, dtype=dtype)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = paged_attention(apply_rope(q, rope), apply_rope(k, rope), v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward with gate and up fused."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(rope, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


# HF checkpoint name fragment -> (our fused parameter, which shard of it)
_PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache; parameter names follow HF's (``model.layers.N...``).

    Weights start uninitialised: make one with ``build_empty_model`` and fill it
    with ``load_weights``.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config)
        self.model = nn.Module()
        # _weight skips the random init: on the meta device normal_() costs a second of imports.
        embedding = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype)
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embedding)
        self.model.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_hidden_layers))
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of a flattened batch of T tokens; K/V land in ``kv_caches``."""
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary(positions)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(rope, x, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[N, vocab]`` of the given hidden states (usually each sequence's last)."""
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (any dtype/device: copy_ casts), fusing q/k/v and gate/up.

        Raises ValueError for an unknown or misshapen tensor, or if any parameter is left unset.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # some old checkpoints save the RoPE buffer
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            target, shard = name, None
            for part, (fused, index) in _PACKED.items():
                if f".{part}." in name:
                    target, shard = name.replace(part, fused), index
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {self.config.architecture}")
            dest = param.data if shard is None else self._shard(param.data, target, shard)
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(name if shard is None else f"{target}#{shard}")
        expected = self._expected_names(params)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {', '.join(missing[:5])}")

    def _shard(self, data: torch.Tensor, name: str, shard: int) -> torch.Tensor:
        """The rows of a fused parameter that one HF tensor fills."""
        if "qkv_proj" in name:
            attn = self.model.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        return data.split(sizes, dim=0)[shard]

    @staticmethod
    def _expected_names(params: dict[str, nn.Parameter]) -> set[str]:
        names = set()
        for name in params:
            if "qkv_proj" in name:
                names.update(f"{name}#{i}" for i in range(3))
            elif "gate_up_proj" in name:
                names.update(f"{name}#{i}" for i in range(2))
            else:
                names.add(name)
        return names


def build_empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """A model with uninitialised weights on ``device``, ready for ``load_weights``.

    Made on the meta device first: random init of a large model would cost more
    than loading it.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(config, dtype)
    model.to_empty(device=device)
    model.rotary.init_cache()
    model.requires_grad_(False)  # inference only: no autograd bookkeeping
    return model.eval()
