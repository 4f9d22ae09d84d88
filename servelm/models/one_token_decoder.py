"""servelm's one-call decoding step for a Llama-family model (``servelm.kernels.OneTokenDecoder``).

With one token in flight, the Python around a step's few hundred small
kernel calls costs as much as the calls themselves; this hands the whole
step of one sequence to one native call that runs the same kernels layer
after layer, bit-identical to the layer-by-layer path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from servelm import kernels

if TYPE_CHECKING:
    from servelm.models.llama import LlamaForCausalLM


def build_one_token_decoder(model: LlamaForCausalLM, kv_caches: list[torch.Tensor]) -> kernels.OneTokenDecoder | None:
    """The one-call decoding step of ``model`` over ``kv_caches``, or None where it does not apply.

    It applies on the CPU in bfloat16 when every linear layer keeps weights
    that one row reads natively (``one_row_weights``: the plain or pair-layout
    weights of packed.py, the int8 ones of quantization.py), there is no q/k
    norm, and the KV cache is bfloat16 or an int8 one the kernels decode.
    """
    native = kernels.for_tensors(model.model.norm.weight)
    if native is None or model.model.norm.weight.dtype != torch.bfloat16 or model.config.qk_norm:
        return None
    cache = kv_caches[0]
    if cache.device.type != "cpu" or cache.dtype not in (torch.bfloat16, torch.int8):
        return None
    if cache.dtype == torch.int8 and not native.decodes_int8_cache(model.config.head_dim):
        return None
    layers = []
    for layer, cache in zip(model.model.layers, kv_caches, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        linears = [getattr(m, "one_row_weights", lambda: None)() for m in modules]
        if any(w is None for w in linears):
            return None
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        layers.append(kernels.DecoderLayerWeights(*norms, *linears, cache))
    attn = model.model.layers[0].self_attn
    norm = model.model.norm
    return native.one_token_decoder(
        layers, norm.weight, model.rotary.cos_sin, heads=attn.num_heads, eps=norm.eps, scale=attn.scale
    )
