"""The one-call decoding step (servelm/kernels/decode_step.c) against the layer-by-layer model it replaces."""

from __future__ import annotations

import pytest
import torch

from servelm import kernels
from servelm.kernels import build
from servelm.models.llama import build_empty_model
from servelm.models.packed import plain_rows

pytestmark = pytest.mark.usefixtures("native_kernels")


def decode(model, config, paged_runner, prompts, steps, one_call: bool, kv_int8: bool = False):
    """Logits of a prefill of each prompt and then `steps` decoding steps of all the sequences together (each
    step leaving one more out, down to one, then all of them again), and the KV caches after them."""
    runner = paged_runner(model, config, block_size=16 if kv_int8 else 4, kv_int8=kv_int8)
    if not one_call:
        model._decoding_step = lambda caches, rows: None  # the layer-by-layer native path
    try:
        names = [f"s{i}" for i in range(len(prompts))]
        logits = runner.step(list(zip(names, prompts, strict=True)))
        tokens = {name: prompt[-1] for name, prompt in zip(names, prompts, strict=True)}
        for i in range(steps):
            batch = names[: len(names) - i % len(names)]
            outs = runner.step([], [(name, tokens[name]) for name in batch])
            for name, out in zip(batch, outs, strict=True):
                logits.append(out)
                tokens[name] = int(out[-1].argmax())
    finally:
        model.__dict__.pop("_decoding_step", None)
    return torch.cat(logits), runner.kv_caches


# 18 tokens: the decodes cross blocks of 4; and prompts of other lengths beside it, for 2 and more rows
ONE = [list(range(3, 21))]
MANY = [list(range(3, 21)), [7, 8, 9], list(range(30, 41)), [5] * 26, [11, 12, 13, 14, 15, 16], [40] * 9] + [
    list(range(50, 50 + n)) for n in (2, 13, 4, 21)
]  # 10 sequences: the w8a8 GEMM runs 8 rows or more on AMX tiles where the CPU has them


@pytest.mark.parametrize("weights", ["bf16", "pairs", "pairs1", "int8", "w8a8"])  # w8a8: one row is int8's GEMV
@pytest.mark.parametrize(
    "overrides",
    [{}, {"attention_bias": True, "attention_out_bias": True}, {"tie_word_embeddings": True}],
    ids=["plain", "biases", "tied"],
)
def test_one_call_step_of_one_sequence_is_bit_identical_to_the_layer_by_layer_path(
    paged_runner, tiny_llama, weights, overrides
):
    model, config = tiny_llama(weights, **overrides)
    fused, fused_caches = decode(model, config, paged_runner, ONE, 9, one_call=True)
    assert model._steps is not None and model._steps[1] is not None  # it did run
    if weights == "pairs" and kernels.cpu_kernels() is not None and "avx512_bf16" in build.cpu_flags():
        assert model.model.layers[0].self_attn.qkv_proj.pair_weight is not None  # the pair layout was read
    layered, layered_caches = decode(model, config, paged_runner, ONE, 9, one_call=False)
    assert torch.equal(fused, layered)
    assert all(torch.equal(a, b) for a, b in zip(fused_caches, layered_caches, strict=True))


def runs_many_rows(weights: str) -> bool:
    """Whether the one-call step takes 2 rows and more of the tiny model with these weights on this CPU."""
    native = kernels.cpu_kernels()
    if weights == "w8a8":
        return "avx512_vnni" in build.cpu_flags()  # the packed GEMM
    if weights == "int8":
        return False  # int8 weights serve one row; more go to oneDNN
    if weights != "bf16" and "avx512_bf16" in build.cpu_flags():
        # the pair layout: on the vector unit, or with one row's layout from 2 rows on AMX tiles
        return weights == "pairs" or native.pairs_amx(64)
    return plain_rows(torch.bfloat16) >= len(MANY)  # no pair layout: the plain weight, read once (AVX2 CPUs)


@pytest.mark.parametrize("weights", ["bf16", "pairs", "pairs1", "int8", "w8a8"])
@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True}], ids=["plain", "biases"])
def test_one_call_step_of_many_sequences_is_bit_identical_to_the_layer_by_layer_path(
    paged_runner, tiny_llama, weights, overrides
):
    model, config = tiny_llama(weights, **overrides)
    fused, fused_caches = decode(model, config, paged_runner, MANY, 14, one_call=True)
    assert (model._steps[2] is not None) == runs_many_rows(weights)
    layered, layered_caches = decode(model, config, paged_runner, MANY, 14, one_call=False)
    assert torch.equal(fused, layered)
    assert all(torch.equal(a, b) for a, b in zip(fused_caches, layered_caches, strict=True))


@pytest.mark.parametrize("prompts", [ONE, MANY], ids=["one", "many"])
def test_one_call_step_over_an_int8_cache_is_bit_identical_to_the_layer_by_layer_path(
    paged_runner, tiny_llama, prompts
):
    """``--kv-cache-dtype int8`` keeps the one-call step where the int8 decode kernel runs (64-dim heads)."""
    if not kernels.cpu_kernels().decodes_int8_cache(64):
        pytest.skip("no AVX512-BF16: the int8 cache is read through PyTorch, and sequences decode layer by layer")
    model, config = tiny_llama("w8a8" if len(prompts) > 1 else "pairs", head_dim=64)
    prompts = [p + list(range(60, 79)) for p in prompts]  # 37 tokens and more: the decodes cross blocks of 16
    fused, fused_caches = decode(model, config, paged_runner, prompts, 12, one_call=True, kv_int8=True)
    assert model._steps[1] is not None and (len(prompts) == 1 or model._steps[2] is not None)  # it did run
    layered, layered_caches = decode(model, config, paged_runner, prompts, 12, one_call=False, kv_int8=True)
    assert fused_caches[0].dtype == torch.int8
    assert torch.equal(fused, layered)
    assert all(torch.equal(a, b) for a, b in zip(fused_caches, layered_caches, strict=True))


def test_it_stands_aside_where_it_does_not_apply(paged_runner, tiny_llama):
    model, config = tiny_llama("bf16", qk_norm=True)  # Qwen3's per-head q/k norm: not in the native step
    decode(model, config, paged_runner, ONE, 1, one_call=True)
    assert model._steps[1] is None and model._steps[2] is None
    unpacked = build_empty_model(config, torch.bfloat16, torch.device("cpu"))  # nn.Linear keeps no kernel weights
    caches = [torch.zeros(2, 8, 4, 2, 16, dtype=torch.bfloat16)] * 3
    assert unpacked._decoding_step(caches, 1) is None and unpacked._decoding_step(caches, 2) is None


def test_many_rows_stay_layer_by_layer_past_what_the_layers_take(tiny_llama):
    """The pair layout takes up to ``PAIR_MAX_ROWS`` rows; past them a step goes layer by layer (oneDNN)."""
    if "avx512_bf16" not in build.cpu_flags():
        pytest.skip("no AVX512-BF16: no pair layout")
    model, _config = tiny_llama("pairs")
    caches = [torch.zeros(2, 8, 4, 2, 16, dtype=torch.bfloat16) for _ in range(3)]
    assert model._decoding_step(caches, 64) is not None
    assert model._decoding_step(caches, 65) is None


def test_it_rejects_what_it_cannot_read(tiny_llama):
    model, _config = tiny_llama("bf16")
    caches = [torch.zeros(2, 8, 4, 2, 16, dtype=torch.bfloat16) for _ in range(3)]
    step = model._decoding_step(caches, 1)
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="past the 1 its linear layers take"):
        step(torch.zeros(2, 64, dtype=torch.bfloat16), torch.tensor([0, 1]), torch.tensor([[0], [1]]))
    with pytest.raises(ValueError, match="contiguous bfloat16 rows"):
        step(x.float(), torch.tensor([0]), torch.tensor([[0]]))
    with pytest.raises(ValueError, match="not covered by its block table"):
        step(x, torch.tensor([4]), torch.tensor([[0]]))  # one block of 4 holds positions 0-3
    with pytest.raises(ValueError, match="positions must be int64"):
        step(x, torch.tensor([0, 1]), torch.tensor([[0]]))
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
    args["intermediate"] = 96
    native.decoding_step([good], **args)
    with pytest.raises(ValueError, match="o has shape"):
        native.decoding_step([good._replace(o=good.qkv)], **args)
    with pytest.raises(ValueError, match="int8 with scales"):
        native.decoding_step([good._replace(o=good.o._replace(weight=good.o.weight.float()))], **args)
    int8 = good.o._replace(kind="int8", weight=torch.zeros(64, 96, dtype=torch.int8), scales=torch.ones(64).bfloat16())
    native.decoding_step([good._replace(o=int8)], **args)
    with pytest.raises(ValueError, match="int8 with scales, for one row"):
        native.decoding_step([good._replace(o=int8._replace(max_rows=2))], **args)
    with pytest.raises(ValueError, match="cannot write silu_mul"):
        native.decoding_step([good._replace(gate_up=good.gate_up._replace(silu_mul=True))], **args)
    with pytest.raises(ValueError, match="packed by w8a8_pack"):
        bogus = good.o._replace(kind="w8a8", scales=torch.ones(64), max_rows=8)
        native.decoding_step([good._replace(o=bogus)], **args)
    with pytest.raises(ValueError, match="contiguous"):
        native.decoding_step([good._replace(kv_cache=caches[0].float())], **args)
