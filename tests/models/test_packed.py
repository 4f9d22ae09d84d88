"""oneDNN-prepacked bfloat16 and float32 linear layers: the maths, the model rewrite, the engine running them."""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from servelm import kernels
from servelm.kernels import build
from servelm.models import packed as packed_mod
from servelm.models.packed import (
    PAIR_MAX_ROWS,
    PackedLinear,
    can_pack,
    packed_dtype,
    pair_rows,
    replace_linears,
    rows_alike,
    timed_pair_rows,
)
from servelm.platform.cpu import onednn_has_bf16

pytestmark = pytest.mark.skipif(not can_pack(torch.float32, torch.device("cpu")), reason="this torch has no oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 7, 64])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("keep_plain", [False, True])  # True: one row goes to servelm's GEMV kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.usefixtures("cpu_ops")
def test_packed_layer_computes_the_plain_linear(rows, with_bias, keep_plain, dtype):
    torch.manual_seed(rows)
    weight = torch.randn(96, 64).to(dtype)
    bias = torch.randn(96).to(dtype) if with_bias else None
    x = torch.randn(rows, 64).to(dtype)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    layer = PackedLinear(weight, bias, keep_plain)
    assert (layer.plain_weight is not None) == keep_plain
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 96)
    if dtype == torch.bfloat16:  # Both round to bfloat16 once; the float32 sums may differ in order only.
        torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
    else:
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_bfloat16_layers_multiply_in_float32_where_onednn_has_no_bfloat16_instructions():
    """The same products and float32 sums as a bfloat16 GEMM's, rounded once: at float32's rate, not at
    emulated bfloat16's; the decoding copy stays bfloat16."""
    weight, bias = torch.randn(96, 64).to(torch.bfloat16), torch.randn(96).to(torch.bfloat16)
    layer = PackedLinear(weight, bias, keep_plain=True)
    assert layer.packed_as == packed_dtype(torch.bfloat16)
    assert layer.packed_as == (torch.bfloat16 if onednn_has_bf16() else torch.float32)
    assert layer.plain_weight.dtype == torch.bfloat16 and layer.bias.dtype == torch.bfloat16
    x = torch.randn(40, 64).to(torch.bfloat16)
    exact = F.linear(x.double(), weight.double(), bias.double())
    # Rounded once from float32 sums: within half a bfloat16 step (at most |exact| / 256) and a float32 sum's error.
    assert ((layer(x).double() - exact).abs() <= exact.abs() / 256 + 1e-4 * exact.abs().max()).all()


def has_avx512_bf16() -> bool:
    return "avx512_bf16" in build.cpu_flags()


@pytest.mark.parametrize("rows", [1, 2, 12, 13, 32, 64, 65])  # tiles of 12 rows, a partial one; 65: oneDNN
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.usefixtures("cpu_ops")
def test_a_few_rows_go_to_the_small_gemm_over_the_pair_layout(rows, with_bias):
    torch.manual_seed(rows)
    weight = torch.randn(96, 64).to(torch.bfloat16)
    bias = torch.randn(96).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 64).to(torch.bfloat16)
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    layer = PackedLinear(weight, bias, pair_rows=PAIR_MAX_ROWS)
    # On an AVX512-BF16 CPU with the kernels built the layer must hold the pair layout, so this tests the kernel.
    assert (layer.pair_weight is not None) == (kernels.cpu_kernels() is not None and has_avx512_bf16())
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


def amx_pairs_run_here() -> bool:
    native = kernels.cpu_kernels()
    return native is not None and native.pairs_amx(64)


@pytest.mark.parametrize("rows", [2, 16, 17, 33, 64, 65])  # tiles of 16 rows, steps of 32; 65: oneDNN
@pytest.mark.parametrize("with_bias", [False, True])
def test_on_amx_cpus_the_rows_past_pair_rows_go_to_the_tile_unit(rows, with_bias):
    if not amx_pairs_run_here():
        pytest.skip("no AMX tile unit here (or Linux did not grant it): oneDNN takes these rows")
    torch.manual_seed(rows)
    weight = torch.randn(96, 64).to(torch.bfloat16)
    bias = torch.randn(96).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 64).to(torch.bfloat16)
    layer = PackedLinear(weight, bias, pair_rows=1)
    assert layer.amx_pairs
    got = layer(x)
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
    if rows <= PAIR_MAX_ROWS:
        native = kernels.cpu_kernels()
        assert torch.equal(got, native.gemm_pairs(x, layer.pair_weight, 96, bias, amx=True))


@pytest.mark.parametrize("kept_rows", [1, PAIR_MAX_ROWS])  # 1: on AMX CPUs 2 to 64 rows go to the tile unit
def test_within_rows_alike_each_row_is_computed_as_it_is_alone(kept_rows):
    """A speculative step's verified rows must get plain decoding's one-row logits, bit for bit."""
    if not small_gemm_runs_here():
        pytest.skip("no small-GEMM kernel here: oneDNN takes every product")
    torch.manual_seed(kept_rows)
    weight, bias = torch.randn(96, 64).to(torch.bfloat16), torch.randn(96).to(torch.bfloat16)
    x = torch.randn(20, 64).to(torch.bfloat16)
    layer = PackedLinear(weight, bias, pair_rows=kept_rows)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(20)])
    with rows_alike():
        together = layer(x)
    assert torch.equal(together, alone)
    expected = F.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(layer(x).float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


def test_the_tile_unit_takes_only_whole_rows_of_32_inputs():
    if not amx_pairs_run_here():
        pytest.skip("no AMX tile unit here (or Linux did not grant it)")
    native = kernels.cpu_kernels()
    weight, x = torch.randn(96, 40).to(torch.bfloat16), torch.randn(20, 40).to(torch.bfloat16)
    assert not native.pairs_amx(40)
    with pytest.raises(ValueError, match="multiple of 32"):
        native.gemm_pairs(x, native.pack_pairs(weight), 96, amx=True)
    layer = PackedLinear(weight, pair_rows=1)
    assert layer.pair_weight is not None and not layer.amx_pairs  # 20 rows: oneDNN
    expected = F.linear(x.float(), weight.float())
    torch.testing.assert_close(layer(x).float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


@pytest.mark.parametrize("shape", [(80, 64), (96, 63)])  # 80 outputs: not whole blocks of 32; odd K
def test_shapes_the_small_gemm_cannot_take_stay_on_onednn(native_kernels, shape):
    weight = torch.randn(*shape).to(torch.bfloat16)
    layer = PackedLinear(weight, pair_rows=PAIR_MAX_ROWS)
    assert layer.pair_weight is None
    x = torch.randn(8, shape[1]).to(torch.bfloat16)
    expected = F.linear(x.float(), weight.float())
    torch.testing.assert_close(layer(x).float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


def test_without_the_kernels_the_small_gemm_is_not_chosen(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_kernels", lambda: None)
    assert timed_pair_rows.__wrapped__() == 0  # not the cached answer: this call's


def small_gemm_runs_here() -> bool:
    return kernels.cpu_kernels() is not None and has_avx512_bf16()


def test_a_pinned_cpu_matmul_runs_no_timing_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(packed_mod, "timed_pair_rows", lambda: pytest.fail("timed although pinned"))
    with caplog.at_level(logging.INFO, logger="servelm.models.packed"):
        assert pair_rows("onednn") == 0
    assert caplog.messages == ["cpu_matmul onednn: decoding's small matmuls use oneDNN, as pinned"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="servelm.models.packed"):
        assert pair_rows("pairs") == (PAIR_MAX_ROWS if small_gemm_runs_here() else 0)
    assert len(caplog.messages) == 1 and caplog.messages[0].startswith("cpu_matmul pairs:")


def test_pairs_pinned_where_the_small_gemm_cannot_run_warns_and_keeps_onednn(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "cpu_kernels", lambda: None)
    with caplog.at_level(logging.WARNING, logger="servelm.models.packed"):
        assert pair_rows("pairs") == 0
    assert "does not run here" in caplog.text and "using oneDNN" in caplog.text


def test_auto_times_once_per_process_and_logs_the_figures(caplog):
    timed_pair_rows.cache_clear()
    with caplog.at_level(logging.INFO, logger="servelm.models.packed"):
        choices = {pair_rows("auto") for _ in range(3)}
    assert len(choices) == 1 and len(caplog.messages) == 1
    (rows,) = choices
    if not small_gemm_runs_here():
        assert rows == 0
        return
    assert rows in (1, PAIR_MAX_ROWS)  # one row at least: as fast as the GEMV, and alike in every engine
    figures = r"takes \d+\.\d+ ms in the pair layout vs \d+\.\d+ ms in oneDNN's: "
    verdict = f"up to {rows} {'row uses' if rows == 1 else 'rows use'} the pair layout, more "
    more = "oneDNN"
    if rows == 1 and kernels.cpu_kernels().pairs_amx(576):  # the rows past it go to the tile unit
        more = f"the same layout on AMX tiles up to {PAIR_MAX_ROWS} rows, then oneDNN"
    assert re.search(figures + verdict + more + "$", caplog.messages[0])


@pytest.mark.model
def test_cpu_matmul_onednn_keeps_plain_weights_without_timing(monkeypatch):
    from servelm import LLM

    monkeypatch.setattr(packed_mod, "timed_pair_rows", lambda: pytest.fail("timed although pinned"))
    llm = LLM("smollm2-135m-instruct", dtype="bfloat16", device="cpu", kv_cache_memory=64 << 20, cpu_matmul="onednn")
    packed = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]
    assert all(m.pair_weight is None and m.plain_weight is not None for m in packed)


@pytest.mark.model
@pytest.mark.parametrize("free_mib,plain,pairs", [(256, False, False), (960, True, False), (1200, False, True)])
def test_extra_weight_copies_are_dropped_where_they_do_not_fit(monkeypatch, free_mib, plain, pairs):
    """A quarter of the free memory is the budget: 64 MiB holds no copy, 240 MiB the plain one (212 MB; the
    tied head's is the embedding) but not the pair layout (269 MB with the head's), 300 MiB the pair layout,
    which then serves batch 1 too, so no layer keeps a plain copy besides."""
    if not onednn_has_bf16():
        pytest.skip("without bfloat16 instructions the layers' float32 copies have a budget of their own (below)")
    if pairs and not timed_pair_rows():
        pytest.skip("the pair layout is kept only where the small GEMM runs (not on this CPU)")
    packed = packed_layers(monkeypatch, free_mib, "bfloat16")
    assert len(packed) == 30 * 4 + 1
    assert all((m.plain_weight is not None) == plain and (m.pair_weight is not None) == pairs for m in packed)


def packed_layers(monkeypatch, free_mib: int, dtype: str) -> list[PackedLinear]:
    """The bundled model's packed layers in ``dtype`` with ``free_mib`` MiB of free memory."""
    from servelm import LLM
    from servelm.models import weight_layout

    monkeypatch.setattr(weight_layout, "free_memory_bytes", lambda device: free_mib << 20)
    model = LLM("smollm2-135m-instruct", dtype=dtype, device="cpu", kv_cache_memory=64 << 20).engine.runner.model
    return [m for m in model.modules() if isinstance(m, PackedLinear)]


@pytest.mark.model
@pytest.mark.parametrize("free_mib,plain", [(256, False), (1800, True)])
def test_float32_layers_keep_a_plain_copy_for_one_row_where_it_fits(monkeypatch, free_mib, plain):
    """424 MB of float32 weights (the tied head's plain one is the embedding): not in a quarter of 256 MiB, in a
    quarter of 1800 MiB. oneDNN's packed weight serves every other product, at any rows."""
    packed = packed_layers(monkeypatch, free_mib, "float32")
    assert len(packed) == 30 * 4 + 1
    assert all(m.packed_as == torch.float32 and m.pair_weight is None for m in packed)
    assert all((m.plain_weight is not None) == plain for m in packed)


@pytest.mark.model
def test_bfloat16_layers_stay_unpacked_where_their_float32_copies_do_not_fit(monkeypatch, caplog):
    """Where oneDNN has no bfloat16 instructions the packed weights are float32: 538 MB for this model, which
    half of 960 MiB cannot hold. The layers then stay as loaded (oneDNN emulating bfloat16), said once."""
    if onednn_has_bf16():
        pytest.skip("oneDNN packs bfloat16 as such on this CPU: no float32 copies")
    with caplog.at_level(logging.WARNING, logger="servelm.models.weight_layout"):
        assert packed_layers(monkeypatch, 960, "bfloat16") == []
    assert "the bfloat16 layers stay unpacked" in caplog.text
    caplog.clear()
    packed = packed_layers(monkeypatch, 1200, "bfloat16")
    assert len(packed) == 30 * 4 + 1 and all(m.packed_as == torch.float32 for m in packed)
    assert "stay unpacked" not in caplog.text


def test_free_memory_counts_the_page_cache_the_kernel_can_reclaim(tmp_path, monkeypatch):
    """The budget for the decoding copies (and a fractional KV cache) is what Linux could hand out now,
    MemAvailable, not the free pages alone: right after the model's files are read most of the memory can be
    page cache. Without that line (older kernels, other systems) the free pages are the answer."""
    from servelm.models import weight_layout

    pages = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}  # the free pages, pinned: the machine's own move
    monkeypatch.setattr(weight_layout.os, "sysconf", lambda name: pages[name])
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         5000000 kB\nMemAvailable:   18000000 kB\n")
    assert weight_layout.available_ram_bytes(str(meminfo)) == 18_000_000 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         5000000 kB\n")
    assert weight_layout.available_ram_bytes(str(meminfo)) == 1000 * 4096
    assert weight_layout.available_ram_bytes(str(tmp_path / "missing")) == 1000 * 4096


def test_leading_axes_are_kept():
    layer = PackedLinear(torch.randn(8, 16).to(torch.bfloat16))
    assert layer(torch.randn(2, 3, 16).to(torch.bfloat16)).shape == (2, 3, 8)


def test_replace_linears_reaches_nested_layers_and_adds_a_tied_head():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False))).to(torch.bfloat16)
    embedding = torch.randn(32, 4).to(torch.bfloat16)
    assert replace_linears(model, PackedLinear, embedding) == 3
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert (model.lm_head.out_features, model.lm_head.in_features) == (32, 4)
    hidden = model[:3](torch.randn(5, 8).to(torch.bfloat16))
    assert hidden.shape == (5, 4) and model.lm_head(hidden).shape == (5, 32)


@pytest.mark.model
def test_engine_in_bfloat16_packs_its_layers_and_stays_close_to_float32(llm):
    from servelm import LLM, SamplingParams

    bf16 = LLM("smollm2-135m-instruct", dtype="bfloat16", device="cpu", kv_cache_memory=64 << 20)
    model = bf16.engine.runner.model
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, PackedLinear)
    assert isinstance(model.lm_head, PackedLinear)  # the tied head, packed apart from the embedding
    # A 135M model's decoding copy fits beside the packed weights: in the pair layout on an AVX512-BF16 CPU
    # (the tied head's too), elsewhere plain (the tied head's plain weight being the embedding itself).
    down, head = model.model.layers[0].mlp.down_proj, model.lm_head
    assert (down.pair_weight is not None) == (timed_pair_rows() > 0)
    assert down.pair_rows == timed_pair_rows()
    if down.pair_weight is not None:
        assert head.pair_weight is not None and down.plain_weight is None and head.plain_weight is None
    else:
        assert down.plain_weight is not None
        assert head.plain_weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    assert bf16.generate(prompt, greedy)[0].outputs[0].text.strip().startswith("Paris")
    if kernels.cpu_kernels() is not None:  # batch-1 decoding went through the one-call native step
        assert model._steps is not None and model._steps[1] is not None
    # Batch-1 decode and a batched step use the same packed weights: the greedy
    # text of a well-determined prompt is the same alone and among others.
    others = ["Once upon a time", "def fibonacci(n):", "The largest planet is"]
    together = bf16.generate([*others, prompt], greedy)
    assert together[-1].outputs[0].text == bf16.generate(prompt, greedy)[0].outputs[0].text
    ids = llm.tokenizer.encode(prompt)
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    ref = llm.generate(ids, one)[0].outputs[0]
    got = bf16.generate(ids, one)[0].outputs[0]
    assert got.token_ids == ref.token_ids
    assert abs(got.logprobs[0].chosen.logprob - ref.logprobs[0].chosen.logprob) < 0.1
