"""Llama-family decoder in plain PyTorch: Llama, Mistral, Qwen2, Qwen3 (and SmolLM, a Llama).

One forward call takes one flattened batch of tokens from many sequences (no
padding) and reads/writes the paged KV cache through ``AttentionMetadata``.
Q/K/V and gate/up projections are fused into one matmul each; ``load_weights``
fuses the HF checkpoint's separate tensors as it copies them in. This file is
the architecture only: each op (norm, RoPE, activation, attention) picks
servelm's native CPU kernel or PyTorch in its module of ``servelm.layers``. A
step in which every sequence decodes one token runs all the layers' native
calls in one (``servelm.models.decoding_step``), bit-identical to calling them
layer by layer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from servelm import kernels
from servelm.layers.activation import silu_and_mul
from servelm.layers.attention import AttentionMetadata, paged_attention
from servelm.layers.linear import FusedLinear
from servelm.layers.norm import RMSNorm
from servelm.layers.rotary import Rope, RotaryEmbedding, split_and_rotate_qkv
from servelm.models.config import ModelConfig
from servelm.models.decoding_step import build_decoding_step
from servelm.models.packed import in_rows_alike


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
        self.qkv_proj = FusedLinear(
            config.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=config.attention_bias, dtype=dtype
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_out_bias, dtype=dtype)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qk_norm = None if self.q_norm is None else (self.q_norm, self.k_norm)
        q, k, v = split_and_rotate_qkv(
            self.qkv_proj(x), rope, self.num_heads, self.num_kv_heads, self.head_dim, qk_norm
        )
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(x.shape[0], self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward with gate and up fused."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = FusedLinear(config.hidden_size, [config.intermediate_size] * 2, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = getattr(self.gate_up_proj, "silu_mul", None)  # w8a8's: in its GEMM (models/w8a8.py)
        return self.down_proj(fused(x) if fused is not None else silu_and_mul(self.gate_up_proj(x)))


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
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.model = nn.Module()
        # _weight skips the random init: on the meta device normal_() costs a second of imports.
        embedding = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype)
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embedding)
        self.model.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_hidden_layers))
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # (caches, the one-call decoding step for one row, for more rows), built on first use
        self._steps: tuple[list[torch.Tensor], kernels.DecodingStep | None, kernels.DecodingStep | None] | None = None
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
        if meta.num_prefills == 0 and kernels.for_tensors(x):
            step = self._decoding_step(kv_caches, x.shape[0])
            if step is not None:  # the same kernels as below, in one native call
                return step(x, positions, meta.block_tables)
        rope = self.rotary(positions)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(rope, x, residual, kv_cache, meta)
        return self.model.norm(x, residual)[0]

    def _decoding_step(self, kv_caches: list[torch.Tensor], rows: int) -> kernels.DecodingStep | None:
        """servelm's one-call decoding step of ``rows`` sequences over these caches (built once), or None where
        it does not apply: there is none for these weights, ``rows`` is past what its layers take, or the rows
        must be computed as one row alone (``packed.rows_alike``), which only the layer path does."""
        if self._steps is None or self._steps[0] is not kv_caches:
            one = build_decoding_step(self, kv_caches, one_row=True)
            self._steps = (kv_caches, one, build_decoding_step(self, kv_caches, one_row=False))
        step = self._steps[1] if rows == 1 else self._steps[2]
        if step is None or rows > step.max_rows or (rows > 1 and in_rows_alike()):
            return None
        return step

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
            if shard is None:
                dest = param.data
            else:  # the rows of the fused layer that this HF tensor fills
                dest = self.get_submodule(target.rpartition(".")[0]).shard(param.data, shard)
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

    def _expected_names(self, params: dict[str, nn.Parameter]) -> set[str]:
        """Every parameter's name, a fused one's once per shard (``name#i``)."""
        names = set()
        for name in params:
            module = self.get_submodule(name.rpartition(".")[0])
            if isinstance(module, FusedLinear):
                names.update(f"{name}#{i}" for i in range(len(module.shard_sizes)))
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
