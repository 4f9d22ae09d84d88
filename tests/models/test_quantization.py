"""Weight-only int8: the layer's maths, the model rewrite, and the engine running it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from servelm.models.packed import can_pack
from servelm.models.quantization import SMALL_BATCH, Int8Linear, quantize_int8


def dequantized(layer: Int8Linear) -> torch.Tensor:
    """The weights the layer computes with, in float32."""
    return layer.qweight.float() * layer.scales.float()[:, None]


def test_int8_weights_stay_within_half_a_step_of_the_original():
    torch.manual_seed(0)
    weight = torch.randn(64, 96) * torch.linspace(0.1, 3, 64)[:, None]  # rows of very different ranges
    layer = Int8Linear(weight)
    assert layer.qweight.dtype == torch.int8 and layer.qweight.abs().max() <= 127
    step = layer.scales.float()[:, None]
    assert ((dequantized(layer) - weight).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("rows", [1, SMALL_BATCH, SMALL_BATCH + 1, 40])
# 100 inputs: a width PyTorch's int8 kernel crashes on, so a few rows take the dense copy there
@pytest.mark.parametrize("in_features", [64, 100])
@pytest.mark.usefixtures("cpu_ops")  # one row goes to servelm's int8 kernel where it is built
def test_small_and_large_batches_compute_with_the_same_quantized_weights(rows, in_features):
    torch.manual_seed(1)
    weight, bias = torch.randn(48, in_features), torch.randn(48)
    layer = Int8Linear(weight, bias)
    x = torch.randn(rows, in_features)
    expected = F.linear(x, dequantized(layer), bias)  # float32 on the dequantized weights
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 48)
    # The int8 kernel takes bf16 activations: agreement to bf16 precision.
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, SMALL_BATCH + 1, 40])
def test_layer_packs_its_dense_copy_for_large_batches(rows, dtype):
    if not can_pack(dtype, torch.device("cpu")):
        pytest.skip("this torch build has no oneDNN packing")
    torch.manual_seed(2)
    weight, bias = torch.randn(48, 64).to(dtype), torch.randn(48).to(dtype)
    layer = Int8Linear(weight, bias)
    assert layer.dense is not None and layer.weight is None  # the packed copy is the only dense one
    x = torch.randn(rows, 64).to(dtype)
    expected = F.linear(x.float(), dequantized(layer), bias.float())
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 48)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def test_leading_axes_are_kept():
    layer = Int8Linear(torch.randn(8, 16))
    assert layer(torch.randn(2, 1, 16)).shape == (2, 1, 8)


def test_quantize_int8_replaces_every_linear_and_adds_a_tied_head():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    embedding = torch.randn(32, 4)
    assert quantize_int8(model, embedding) == 3
    assert [type(m).__name__ for m in model.modules()].count("Linear") == 0
    assert isinstance(model[0], Int8Linear) and isinstance(model[2][0], Int8Linear)
    assert model.lm_head.out_features == 32 and model.lm_head.in_features == 4


@pytest.mark.model
def test_engine_runs_int8_close_to_float32(llm):
    from servelm import LLM, SamplingParams

    int8 = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", kv_cache_memory=64 << 20, quantization="int8")
    runner = int8.engine.runner
    assert isinstance(runner.model.lm_head, Int8Linear)
    assert isinstance(runner.model.model.layers[0].mlp.down_proj, Int8Linear)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    prompt = "The capital of France is"
    # Batch 1 decodes through the int8 kernel; the well-determined answer survives quantization.
    assert int8.generate(prompt, greedy)[0].outputs[0].text.strip().startswith("Paris")
    # Next-token distributions stay close to float32's on a prompt.
    ids = llm.tokenizer.encode(prompt)
    ref = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=1, logprobs=5))[0].outputs[0]
    got = int8.generate(ids, SamplingParams(temperature=0.0, max_tokens=1, logprobs=5))[0].outputs[0]
    assert got.token_ids == ref.token_ids
    assert abs(got.logprobs[0].chosen.logprob - ref.logprobs[0].chosen.logprob) < 0.1


@pytest.mark.model
@pytest.mark.parametrize("free_mib", [256, 4096])
def test_int8_weights_move_to_huge_pages_only_where_the_copy_fits(monkeypatch, free_mib):
    from servelm import LLM
    from servelm.models import weight_layout

    moved = []
    real_copies = weight_layout.huge_page_copies
    monkeypatch.setattr(weight_layout, "free_memory_bytes", lambda device: free_mib << 20)
    monkeypatch.setattr(weight_layout, "huge_page_copies", lambda ts: moved.extend(ts) or real_copies(ts))
    runner = LLM("smollm2-135m-instruct", device="cpu", kv_cache_memory=64 << 20, quantization="int8").engine.runner
    qweights = [m.qweight for m in runner.model.modules() if isinstance(m, Int8Linear)]
    # ~135 MB of int8 weights: their second copy does not fit in half of 256 MiB, and does in 4 GiB.
    assert len(moved) == (len(qweights) if free_mib == 4096 else 0)


def test_an_unknown_quantization_is_refused():
    from servelm.engine.config import EngineConfig

    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")
