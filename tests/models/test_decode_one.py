"""The one-call decoding step (servelm/kernels/decode_one.c) against the layer-by-layer model it replaces."""

from __future__ import annotations

import pytest
import torch

from servelm import kernels
from servelm.kernels import build
from servelm.models.llama import build_empty_model

pytestmark = pytest.mark.usefixtures("native_kernels")


def decode(model, config, paged_runner, prompt, steps, one_call: bool, kv_int8: bool = False):
    """Logits of a prefill and then `steps` single-sequence decodes, and the KV caches after them."""
    runner = paged_runner(model, config, block_size=16 if kv_int8 else 4, kv_int8=kv_int8)
    if not one_call:
        model._one_token_decoder = lambda caches: None  # the layer-by-layer native path
    try:
        logits = runner.step([("a", prompt)])
        token = prompt[-1]
        for _ in range(steps):
            out = runner.step([], [("a", token)])[0]
            logits.append(out)
            token = int(out[-1].argmax())
    finally:
        model.__dict__.pop("_one_token_decoder", None)
    return torch.cat(logits), runner.kv_caches


@pytest.mark.parametrize("weights", ["bf16", "pairs", "int8", "w8a8"])  # w8a8: one row is int8's GEMV
@pytest.mark.parametrize(
    "overrides",
    [{}, {"attention_bias": True, "attention_out_bias": True}, {"tie_word_embeddings": True}],
    ids=["plain", "biases", "tied"],
)
def test_one_call_step_is_bit_identical_to_the_layer_by_layer_path(paged_runner, tiny_llama, weights, overrides):
    model, config = tiny_llama(weights, **overrides)
    prompt = list(range(3, 21))  # 18 tokens: the decodes cross blocks of 4
    fused, fused_caches = decode(model, config, paged_runner, prompt, 9, one_call=True)
    assert model._decoder is not None and model._decoder[1] is not None  # it did run
    if weights == "pairs" and kernels.cpu_kernels() is not None and "avx512_bf16" in build.cpu_flags():
        assert model.model.layers[0].self_attn.qkv_proj.pair_weight is not None  # the pair layout was read
    layered, layered_caches = decode(model, config, paged_runner, prompt, 9, one_call=False)
    assert torch.equal(fused, layered)
    assert all(torch.equal(a, b) for a, b in zip(fused_caches, layered_caches))


def test_one_call_step_over_an_int8_cache_is_bit_identical_to_the_layer_by_layer_path(paged_runner, tiny_llama):
    """``--kv-cache-dtype int8`` keeps the one-call step where the int8 decode kernel runs (64-dim heads)."""
    if not kernels.cpu_kernels().decodes_int8_cache(64):
        pytest.skip("no AVX512-BF16: the int8 cache is read through PyTorch, and one sequence decodes layer by layer")
    model, config = tiny_llama("pairs", head_dim=64)
    prompt = list(range(3, 40))  # 37 tokens: the decodes cross into a third block of 16
    fused, fused_caches = decode(model, config, paged_runner, prompt, 12, one_call=True, kv_int8=True)
    assert model._decoder is not None and model._decoder[1] is not None  # it did run
    layered, layered_caches = decode(model, config, paged_runner, prompt, 12, one_call=False, kv_int8=True)
    assert fused_caches[0].dtype == torch.int8
    assert torch.equal(fused, layered)
    assert all(torch.equal(a, b) for a, b in zip(fused_caches, layered_caches))


def test_it_stands_aside_where_it_does_not_apply(paged_runner, tiny_llama):
    model, config = tiny_llama("bf16", qk_norm=True)  # Qwen3's per-head q/k norm: not in the native step
    decode(model, config, paged_runner, [5, 6, 7], 1, one_call=True)
    assert model._decoder[1] is None
    unpacked = build_empty_model(config, torch.bfloat16, torch.device("cpu"))  # nn.Linear keeps no kernel weights
    assert unpacked._one_token_decoder([torch.zeros(2, 8, 4, 2, 16, dtype=torch.bfloat16)] * 3) is None


def test_it_rejects_what_it_cannot_read(tiny_llama):
    from servelm import kernels

    model, _config = tiny_llama("bf16")
    caches = [torch.zeros(2, 8, 4, 2, 16, dtype=torch.bfloat16) for _ in range(3)]
    decoder = model._one_token_decoder(caches)
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one contiguous bfloat16 row"):
        decoder(torch.zeros(2, 64, dtype=torch.bfloat16), 0, torch.tensor([0]))
    with pytest.raises(ValueError, match="cover the position"):
        decoder(x, 4, torch.tensor([0]))  # one block of 4 holds positions 0-3
    native = kernels.cpu_kernels()
    layer = model.model.layers[0]
    good = kernels.DecoderLayerWeights(
        layer.input_layernorm.weight,
        layer.post_attention_layernorm.weight,
        *(
            m.one_row_weights()
            for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        ),
        caches[0],
    )
    args = dict(final_norm=model.model.norm.weight, cos_sin=model.rotary.cos_sin, heads=6, eps=1e-5, scale=0.25)
    native.one_token_decoder([good], **args)
    with pytest.raises(ValueError, match="o has shape"):
        native.one_token_decoder([good._replace(o=good.qkv)], **args)
    with pytest.raises(ValueError, match="int8 with scales"):
        native.one_token_decoder([good._replace(o=good.o._replace(weight=good.o.weight.float()))], **args)
    with pytest.raises(ValueError, match="contiguous"):
        native.one_token_decoder([good._replace(kv_cache=caches[0].float())], **args)
