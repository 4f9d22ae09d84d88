"""W8A8 (int8 weights x int8 activations): the kernel against references, its argument checks, the layer on
both paths, and the engine running a model with ``quantization="w8a8"``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from servelm.models.quantization import Int8Rows
from servelm.models.w8a8 import W8A8Linear, quantize_activations, quantize_w8a8

# (M, K, N): ragged rows (1, 5, past one 48-row work item, past one 6-row tile), outputs not a multiple of 16
# (12, 33, 70: a 64-wide panel and a remainder), inputs a multiple of 4 or not (37, 101: padded).
SHAPES = [(1, 40, 12), (5, 36, 33), (7, 37, 50), (49, 64, 70), (100, 101, 16), (13, 576, 200)]


def int8_reference(x: torch.Tensor, layer: W8A8Linear) -> torch.Tensor:
    """What the int8 arithmetic gives exactly: quantized rows times int8 weights in float64, scaled back."""
    q, row_scales = quantize_activations(x)
    out = (q.double() @ layer.qweight.double().T) * row_scales.double() * layer.weight_scales.double()
    return out if layer.bias is None else out + layer.bias.double()


def float_error_bound(x: torch.Tensor, weight: torch.Tensor, layer: W8A8Linear) -> torch.Tensor:
    """How far W8A8 may be from the float product x W^T: each activation is off by at most half its row's
    step s_x, each weight by half its row's step s_w, so (x + dx)(w + dw) - x w is at most
    sum_k (|x_k| s_w + |w_k| s_x + s_x s_w / 2) / 2, per output ``[M, N]``."""
    xd, wd = x.double(), weight.double()
    s_x = xd.abs().amax(1, keepdim=True) / 127
    s_w = layer.weight_scales.double()
    return (xd.abs().sum(1, keepdim=True) * s_w + s_x * wd.abs().sum(1) + s_x * s_w * x.shape[1] / 2) / 2


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("cpu_ops")  # the VNNI kernel where it is built, torch._int_mm where not
def test_w8a8_linear_is_the_int8_product_and_within_the_bound_of_the_float_one(m, k, n, dtype):
    gen = torch.Generator().manual_seed(m * 1000 + n)
    weight = torch.randn(n, k, generator=gen) * torch.linspace(0.2, 2, n)[:, None]  # rows of different ranges
    bias = torch.randn(n, generator=gen).to(dtype)
    x = (torch.randn(m, k, generator=gen) * torch.linspace(0.5, 3, m)[:, None]).to(dtype)
    x[:, k // 2] *= 8  # an outlier column, as real activations have
    layer = W8A8Linear(weight.to(dtype), bias)
    got = layer(x)
    assert got.dtype == dtype and got.shape == (m, n)
    # One bfloat16 row goes to the weight-only int8 kernel (no activation rounding): only the float bound holds.
    if not (m == 1 and dtype == torch.bfloat16):
        exact = int8_reference(x, layer)
        # int32 sums are exact; float32 scaling, and rounding the output to bfloat16, are all that differ.
        rounding = 1e-5 if dtype == torch.float32 else 2**-8
        assert ((got.double() - exact).abs() <= rounding * exact.abs() + 1e-4).all()
    original = weight.to(dtype).double()
    float_out = x.double() @ original.T + bias.double()
    out_rounding = (2**-8 if dtype == torch.bfloat16 else 1e-5) * got.double().abs()
    assert ((got.double() - float_out).abs() <= float_error_bound(x, original, layer) + out_rounding + 1e-4).all()


def test_zero_rows_and_a_zero_row_among_others(native_kernels):
    layer = W8A8Linear(torch.randn(20, 32))
    assert layer(torch.zeros(0, 32)).shape == (0, 20)
    x = torch.randn(3, 32)
    x[1] = 0  # max |row| = 0: no division by it, the row's products are 0
    out = layer(x)
    assert torch.equal(out[1], torch.zeros(20)) and torch.isfinite(out).all()


def test_without_the_kernels_one_warning_names_the_slower_path(monkeypatch, caplog):
    from servelm import kernels
    from servelm.models import w8a8

    monkeypatch.setattr(kernels, "cpu_kernels", lambda: None)
    w8a8._warn_portable.cache_clear()
    with caplog.at_level("WARNING", logger="servelm.models.w8a8"):
        layers = [W8A8Linear(torch.randn(8, 16)) for _ in range(3)]
    assert all(layer.packed is None for layer in layers)
    assert [r.getMessage() for r in caplog.records] == [
        "w8a8: servelm's int8 GEMM does not run here (servelm's CPU kernels are unavailable): "
        "torch._int_mm runs instead, slower"
    ]
    w8a8._warn_portable.cache_clear()


def test_leading_axes_are_kept():
    layer = W8A8Linear(torch.randn(8, 16))
    assert layer(torch.randn(2, 3, 16)).shape == (2, 3, 8)


def test_the_packed_layout_is_made_where_the_kernel_runs(native_kernels):
    layer = W8A8Linear(torch.randn(33, 37))
    assert (layer.packed is not None) == (native_kernels.w8a8_pack(torch.zeros(1, 1, dtype=torch.int8)) is not None)
    if layer.packed is not None:
        # Padded to 16 outputs x 4 inputs (64 inputs, a tile's row, where AMX may run), then compensations,
        # then N and K.
        sizes = {48 * 40 + 4 * 48 + 8, 48 * 64 + 4 * 48 + 8}
        assert layer.packed.numel() in sizes
        if native_kernels.w8a8_use_amx():
            assert layer.packed.numel() == 48 * 64 + 4 * 48 + 8


# Rows around AMX's steps (8 the first it takes, 16 one tile, 32 two) and past one 256-row work item; outputs
# in an odd number of 16-blocks (the last step has one), in fewer pairs of blocks than threads (12), in more
# than one work item (300), and split into items of uneven sizes (18 pairs at 576: 4, 5, 4, 5 on two threads);
# inputs not a multiple of 64 (a tile's row).
AMX_SHAPES = [(7, 64, 32), (8, 37, 12), (16, 101, 33), (17, 64, 70), (33, 576, 200), (300, 100, 300), (32, 64, 576)]


@pytest.mark.parametrize(("m", "k", "n"), AMX_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amx_and_vnni_give_the_same_output_to_the_last_bit(native_kernels, m, k, n, dtype):
    if not native_kernels.w8a8_use_amx():
        pytest.skip("this CPU has no AMX-INT8 (or Linux did not grant its tiles): only the VNNI path runs")
    gen = torch.Generator().manual_seed(m * 1000 + n)
    layer = W8A8Linear(torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype))
    x = (torch.randn(m, k, generator=gen) * torch.linspace(0.5, 3, m)[:, None]).to(dtype)
    args = (x, layer.packed, layer.weight_scales, n, layer.bias)
    try:
        assert native_kernels.w8a8_use_amx(False) is False
        vnni = native_kernels.w8a8_linear(*args)
    finally:
        assert native_kernels.w8a8_use_amx(True) is True
    amx = native_kernels.w8a8_linear(*args)
    assert torch.equal(amx, vnni)
    # and both are the int8 product (the test above checks the path that runs by default in detail)
    exact = int8_reference(x, layer)
    rounding = 1e-5 if dtype == torch.float32 else 2**-8
    assert ((amx.double() - exact).abs() <= rounding * exact.abs() + 1e-4).all()


@pytest.mark.parametrize("m", [1, 2, 8, 33, 300])
@pytest.mark.usefixtures("cpu_ops")
def test_an_lm_heads_float32_logits_are_its_bfloat16_outputs_widened(m):
    gen = torch.Generator().manual_seed(m)
    head = W8A8Linear(torch.randn(200, 64, generator=gen).bfloat16())
    x = torch.randn(m, 64, generator=gen).bfloat16()
    rounded = head(x)
    head.float_out = True  # as quantize_w8a8 sets it on a model's head
    logits = head(x)
    assert logits.dtype == torch.float32 and torch.equal(logits, rounded.float())


def w8a8_args(native_kernels) -> dict:
    qweight = torch.randint(-127, 128, (20, 36), dtype=torch.int8)
    packed = native_kernels.w8a8_pack(qweight)
    if packed is None:
        pytest.skip("this CPU has no AVX512-VNNI: the W8A8 kernel does not run")
    return dict(x=torch.randn(3, 36), packed=packed, scales=torch.rand(20), out_features=20, bias=torch.randn(20))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(x=torch.randn(3, 40)), "packed must be"),  # another in_features than the packed weight's
        (dict(out_features=36), "packed must be"),
        (dict(x=torch.randn(2, 3, 36)), "x must be"),
        (dict(x=torch.randint(0, 9, (3, 36))), "bfloat16 or float32"),
        (dict(x=torch.randn(3, 36).half()), "bfloat16 or float32"),
        (dict(packed="int32"), "packed must be"),
        (dict(scales=torch.rand(20).bfloat16()), "scales must be"),
        (dict(scales=torch.rand(19)), "scales must be"),
        (dict(bias=torch.randn(19)), "bias must be"),
        (dict(bias=torch.randn(20).bfloat16()), "one dtype"),
        (dict(out_features=0), "x must be"),
        (dict(x=torch.randn(1, 65540)), "65536"),  # its int32 sums could overflow
    ],
)
def test_w8a8_linear_refuses_what_its_kernel_cannot_read(native_kernels, change, message):
    args = w8a8_args(native_kernels)
    if change.get("packed") == "int32":
        change = dict(packed=args["packed"].view(torch.int32))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        native_kernels.w8a8_linear(**args)


def test_w8a8_pack_refuses_a_weight_that_is_not_int8(native_kernels):
    with pytest.raises(ValueError, match="int8"):
        native_kernels.w8a8_pack(torch.randn(4, 4))
    with pytest.raises(ValueError, match="int8"):
        native_kernels.w8a8_pack(torch.zeros(0, 4, dtype=torch.int8))


def test_quantize_w8a8_quantizes_every_linear_and_a_tied_head():
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 4, bias=False)))
            self.lm_head = None  # tied to an embedding

    model = Tiny()
    embedding = torch.randn(32, 4)
    assert quantize_w8a8(model, embedding) == 3
    assert isinstance(model.model[0], W8A8Linear) and isinstance(model.model[1][0], W8A8Linear)
    assert isinstance(model.lm_head, W8A8Linear) and model.lm_head.out_features == 32
    assert model.lm_head.float_out and not model.model[0].float_out  # the head's logits come out in float32
    # the same int8 rows as weight-only int8 makes of the same weight
    rows = Int8Rows(embedding)
    assert torch.equal(model.lm_head.qweight, rows.qweight) and torch.equal(model.lm_head.scales, rows.scales)


def test_the_setting_flows_into_the_engine_config():
    from servelm.engine.config import EngineConfig
    from servelm.settings import Settings

    assert Settings(quantization="w8a8").engine_config().quantization == "w8a8"
    assert EngineConfig(quantization="w8a8").quantization == "w8a8"
    with pytest.raises(ValueError, match="w8a8"):
        EngineConfig(quantization="w4a8")


# A 135M model's greedy text forks at the first close call and rarely rejoins (over bench/quant_quality.py's
# 12 prompts x 48 tokens ~30% of w8a8's tokens match bfloat16's at the same position), so one near tie costs
# a prompt all its later tokens: on these 4 prompts 41, then 38, then 27 of 48 as the attention kernels'
# rounding moved (the last at a tie, "def fibonacci(n):"'s second token, where e0f18b0's w8a8 gave the two
# candidates the same logprob). Asserted instead: w8a8's next token after each of bfloat16's prefixes
# (teacher-forced, prompt logprobs) is bfloat16's at 80% of the 48 positions (measured: 45 at e0f18b0, 43
# after the prefill attention's pair layout); a broken int8 path falls far below.
@pytest.mark.model
def test_engine_runs_w8a8_close_to_bfloat16():
    from servelm import LLM, SamplingParams

    prompts = ["The capital of France is", "1, 2, 3, 4, 5,", "def fibonacci(n):", "Water boils at a temperature of"]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    bf16 = LLM("smollm2-135m-instruct", dtype="bfloat16", device="cpu", kv_cache_memory=64 << 20)
    reference = bf16.generate(prompts, greedy)
    del bf16
    llm = LLM("smollm2-135m-instruct", dtype="bfloat16", device="cpu", kv_cache_memory=64 << 20, quantization="w8a8")
    model = llm.engine.runner.model
    assert isinstance(model.model.layers[0].mlp.down_proj, W8A8Linear)
    assert isinstance(model.lm_head, W8A8Linear)
    outputs = [o.outputs[0] for o in llm.generate(prompts, greedy)]
    # Well-determined continuations survive int8 activations.
    assert outputs[0].text.strip().startswith("Paris")
    assert outputs[1].text.strip().startswith("6, 7")
    texts = [o.prompt_token_ids + list(o.outputs[0].token_ids) for o in reference]
    scored = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=1))
    same = sum(
        out.prompt_logprobs[pos].top[0].token_id == text[pos]
        for out, text, ref in zip(scored, texts, reference)
        for pos in range(len(ref.prompt_token_ids), len(text))
    )
    assert same >= 0.8 * 12 * len(prompts)


@pytest.mark.model
def test_packed_weights_move_to_huge_pages_beside_the_int8_rows(monkeypatch):
    """Decoding's GEMM streams the packed layout once a step: it goes into the huge-page arena (one storage
    for every layer) with the rows the one-row GEMV reads."""
    from servelm import LLM
    from servelm.models import weight_layout

    moved = []
    real_copies = weight_layout.huge_page_copies
    monkeypatch.setattr(weight_layout, "free_memory_bytes", lambda device: 4096 << 20)
    monkeypatch.setattr(weight_layout, "huge_page_copies", lambda ts: moved.extend(ts) or real_copies(ts))
    llm = LLM("smollm2-135m-instruct", dtype="bfloat16", device="cpu", kv_cache_memory=64 << 20, quantization="w8a8")
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, W8A8Linear)]
    if layers[0].packed is None:
        pytest.skip("no AVX512-VNNI: no packed layout to move")
    assert len(moved) == 2 * len(layers)  # each layer's int8 rows and its packed layout
    arenas = {t.untyped_storage().data_ptr() for m in layers for t in (m.qweight, m.packed)}
    assert len(arenas) == 1
