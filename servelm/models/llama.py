"""Llama-family decoder in plain PyTorch: Llama, Mistral, Qwen2, Qwen3 (and SmolLM, a Llama).

One forward call takes one flattened batch of tokens from many sequences (no
padding) and reads/writes the paged KV cache through ``AttentionMetadata``.
Q/K/V and gate/up projections are fused into one matmul each; ``load_weights``
fuses the HF checkpoint's separate tensors as it copies them in. On CPU, the
elementwise chains (residual add + RMSNorm, RoPE, SiLU * up) run as one native
call each where servelm's kernels are built (``servelm.kernels``); the PyTorch
code beside each is the reference they match and the path everywhere else. A
step that decodes a single sequence runs all the layers' native calls in one
(``_one_token_decoder``), bit-identical to calling them layer by layer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from servelm import kernels
from servelm.models.attention import AttentionMetadata, paged_attention
from servelm.models.config import ModelConfig


def _native(*tensors: torch.Tensor) -> kernels.CpuKernels | None:
    """servelm's CPU kernels if these tensors are contiguous and the kernels take them, else None (PyTorch path)."""
    return kernels.for_tensors(*tensors) if all(t.is_contiguous() for t in tensors) else None


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like HF's LlamaRMSNorm.

    Called with a ``residual`` it first adds ``x`` to it and normalises the sum,
    returning ``(normed, new residual)``; the native kernel updates the residual
    in place.
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            native = _native(x, self.weight)
            return native.rms_norm(x, self.weight, self.eps) if native else self._norm(x)
        native = _native(x, residual, self.weight)
        if native:
            return native.rms_norm(x, self.weight, self.eps, residual), residual
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
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


class Rope(NamedTuple):
    cos: torch.Tensor  # [T, 1, head_dim // 2] float32, for the tokens' positions
    sin: torch.Tensor
    table: torch.Tensor  # [max_positions, head_dim] float32: cos then sin (the native kernel reads it)
    positions: torch.Tensor  # [T] int64


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

    def forward(self, positions: torch.Tensor) -> Rope:
        """The tokens' rotation, shared by every layer."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return Rope(cos, sin, self.cos_sin, positions)


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate ``[T, heads, head_dim]`` by (cos, sin), in float32 for accuracy at low precision."""
    cos, sin = rope.cos, rope.sin
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

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        native = _native(qkv) if self.q_norm is None else None
        if native:  # rotate q and k where they lie, side by side at the start of each row
            native.rope_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, rope.table, rope.positions)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if not native:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward with gate and up fused."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        native = _native(gate_up)
        if native:
            return self.down_proj(native.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block.

    Takes and returns the residual stream apart from the sublayer output (as
    vLLM does), so that each residual add fuses into the next norm:
    ``residual + x`` is the block's input, None for the first block.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(
        self,
        rope: Rope,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(rope, x, kv_cache, meta), residual)
        return self.mlp(x), residual


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
        self._decoder: tuple[list[torch.Tensor], kernels.OneTokenDecoder | None] | None = None  # (caches, decoder)
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
        if meta.num_prefills == 0 and x.shape[0] == 1 and kernels.for_tensors(x):
            decoder = self._one_token_decoder(kv_caches)
            if decoder is not None:  # the same kernels as below, in one native call
                return decoder(x, meta.context_lens[0] - 1, meta.block_tables[0])
        rope = self.rotary(positions)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(rope, x, residual, kv_cache, meta)
        return self.model.norm(x, residual)[0]

    def _one_token_decoder(self, kv_caches: list[torch.Tensor]) -> kernels.OneTokenDecoder | None:
        """servelm's one-call decoding step over these caches (built once), or None where it does not apply.

        It applies on the CPU in bfloat16 when every linear layer keeps weights
        that one row reads natively (``one_row_weights``: the plain weights of
        packed.py, the int8 ones of quantization.py) and there is no q/k norm.
        """
        if self._decoder is None or self._decoder[0] is not kv_caches:
            self._decoder = (kv_caches, self._build_one_token_decoder(kv_caches))
        return self._decoder[1]

    def _build_one_token_decoder(self, kv_caches: list[torch.Tensor]) -> kernels.OneTokenDecoder | None:
        native = kernels.for_tensors(kv_caches[0], self.model.norm.weight)
        if native is None or kv_caches[0].dtype != torch.bfloat16 or self.config.qk_norm:
            return None
        layers = []
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            linears = [getattr(m, "one_row_weights", lambda: None)() for m in modules]
            if any(w is None for w in linears):
                return None
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            layers.append(kernels.DecoderLayerWeights(*norms, *linears, cache))
        attn = self.model.layers[0].self_attn
        norm = self.model.norm
        return native.one_token_decoder(
            layers, norm.weight, self.rotary.cos_sin, heads=attn.num_heads, eps=norm.eps, scale=attn.scale
        )

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
