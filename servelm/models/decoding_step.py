"""servelm's one-call decoding step for a Llama-family model (``servelm.kernels.DecodingStep``).

Decoding runs a few hundred small kernel calls a step: for one sequence the
Python around them costs as much as the calls themselves, and for a few dozen
sequences still a fifth of the step or so. This hands a step in which every
sequence decodes one token to one native call that runs the same kernels
layer after layer, bit-identical to the layer-by-layer path.

A layer's kernel depends on how many rows it multiplies (one row reads
``one_row_weights``, the int8 matrix-vector kernel's or the pair layout's;
more read ``rows_weights``, W8A8's packed GEMM or the pair layout up to its
rows), so a model has two steps: one for a single sequence and one for more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from servelm import kernels

if TYPE_CHECKING:
    from servelm.models.llama import LlamaForCausalLM


def build_decoding_step(
    model: LlamaForCausalLM, kv_caches: list[torch.Tensor], one_row: bool
) -> kernels.DecodingStep | None:
    """The one-call decoding step of ``model`` over ``kv_caches`` for one row (``one_row``) or for 2 rows
    and more, or None where it does not apply.

    It applies on the CPU in bfloat16 when every linear layer keeps weights
    that the native step reads for that many rows (``one_row_weights`` or
    ``rows_weights``: packed.py's plain or pair-layout weights, quantization.py's
    int8 rows, w8a8.py's packed ones), there is no q/k norm, and the KV cache
    is bfloat16 or an int8 one the kernels decode.
    """
    native = kernels.for_tensors(model.model.norm.weight)
    if native is None or model.model.norm.weight.dtype != torch.bfloat16 or model.config.qk_norm:
        return None
    cache = kv_caches[0]
    if cache.device.type != "cpu" or cache.dtype not in (torch.bfloat16, torch.int8):
        return None
    if cache.dtype == torch.int8 and not native.decodes_int8_cache(model.config.head_dim):
        return None
    reader = "one_row_weights" if one_row else "rows_weights"
    layers = []
    for layer, cache in zip(model.model.layers, kv_caches, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        linears = [getattr(m, reader, lambda: None)() for m in modules]
        if any(w is None for w in linears):
            return None
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        layers.append(kernels.DecoderLayerWeights(*norms, *linears, cache))
    attn = model.model.layers[0].self_attn
    norm = model.model.norm
    return native.decoding_step(
        layers,
        norm.weight,
        model.rotary.cos_sin,
        heads=attn.num_heads,
        intermediate=model.config.intermediate_size,
        eps=norm.eps,
        scale=attn.scale,
    )
