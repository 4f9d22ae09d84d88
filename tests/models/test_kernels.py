"""servelm's native CPU kernels: building and caching them, their guards, and each fused op against the
PyTorch code it replaces.

Decode attention's numerics are covered in test_attention.py (every case runs on both paths), and the
whole model in test_llama.py (against transformers, on both paths).
"""

from __future__ import annotations

import logging
import os
import shutil
import time

import pytest
import torch
import torch.nn.functional as F

from servelm import kernels
from servelm.kernels.self_check import self_check
from servelm.layers.norm import RMSNorm
from servelm.layers.rotary import Rope, apply_rope
from servelm.platform.cache import STALE_SECONDS

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None or shutil.which("c++") is None, reason="no C and C++ compilers on this machine"
)


@pytest.fixture
def native(native_kernels):
    """A short name for the tests below."""
    return native_kernels


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty kernel cache directory and no memoised build; the memo is cleared again afterwards."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    kernels.cpu_kernels.cache_clear()
    yield tmp_path / "servelm" / "kernels"
    kernels.cpu_kernels.cache_clear()


@needs_compiler
def test_built_once_then_reused_from_the_cache_and_a_new_build_deletes_builds_unused_for_a_month(fresh):
    # One test, as a build takes seconds: the first call builds (and prunes), the second reuses it.
    fresh.mkdir(parents=True)
    stale, recent = fresh / "servelm_kernels-0000000000000000.so", fresh / "servelm_kernels-1111111111111111.so"
    for path in (stale, recent):
        path.write_bytes(b"an older servelm's build")
    month_ago = time.time() - STALE_SECONDS - 60
    os.utime(stale, (month_ago, month_ago))
    assert kernels.cpu_kernels() is not None
    (built,) = set(fresh.glob("servelm_kernels-*.so")) - {recent}
    assert sorted(p.name for p in fresh.iterdir()) == sorted([recent.name, built.name])  # the stale one went
    stamp = built.stat().st_mtime_ns
    kernels.cpu_kernels.cache_clear()
    assert kernels.cpu_kernels() is not None
    assert sorted(p.name for p in fresh.iterdir()) == sorted([recent.name, built.name])  # no second build
    assert built.stat().st_mtime_ns == stamp


@pytest.mark.parametrize("variable,kind", [("CC", "C"), ("CXX", "C++")])
def test_no_compiler_means_the_pytorch_path(fresh, monkeypatch, caplog, variable, kind):
    monkeypatch.setenv(variable, "servelm-no-such-compiler")
    with caplog.at_level(logging.WARNING, logger="servelm.kernels"):
        assert kernels.cpu_kernels() is None
    assert f"no {kind} compiler (servelm-no-such-compiler)" in caplog.text
    assert len([r for r in caplog.records if r.name.startswith("servelm.kernels")]) == 1  # one warning


def test_failed_build_means_the_pytorch_path(fresh, monkeypatch, tmp_path, caplog):
    fake = tmp_path / "brokencc"
    fake.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo brokencc 1.0; exit 0; fi\necho "boom" >&2\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with caplog.at_level(logging.WARNING, logger="servelm.kernels"):
        assert kernels.cpu_kernels() is None
    assert "boom" in caplog.text
    assert not list(fresh.glob("*.so"))


@pytest.mark.parametrize(
    "broken",
    ["decode_attention", "rms_norm", "silu_mul", "log_softmax_stats", "write_kv", "int8_linear", "gemv", "gemm_pairs"],
)
def test_self_check_rejects_wrong_results(native, broken):
    self_check(native)  # the real build passes
    if broken == "gemm_pairs" and native.pack_pairs(torch.zeros(32, 2, dtype=torch.bfloat16)) is None:
        pytest.skip("the small-GEMM kernel is built for AVX512-BF16 CPUs only; the self-check has nothing to run")

    class Miscompiled(kernels.CpuKernels):
        pass

    def zeros(self, x, *args):
        if broken == "log_softmax_stats":  # each row's largest value, its index and its logsum
            return x.new_zeros(len(x)), x.new_zeros(len(x), dtype=torch.long), x.new_zeros(len(x))
        return torch.zeros_like(x)

    setattr(Miscompiled, broken, zeros)
    with pytest.raises(RuntimeError, match=f"{broken} in torch.float32 differs"):
        self_check(Miscompiled())


def test_self_check_rejects_a_wrong_prefill(native):
    class Miscompiled(kernels.CpuKernels):
        def prefill_attention(self, query, kv_cache, block_tables, seq_lens, scale, out):
            out.zero_()
            return True

    with pytest.raises(RuntimeError, match=r"prefill_attention in torch\.bfloat16 differs"):
        self_check(Miscompiled())


DTYPES = [torch.float32, torch.bfloat16]


def assert_same_rounding(got: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: equal to float32 noise. bfloat16: almost all the same value, the rest at most two
    steps of bfloat16 apart (float32 sums in another order, or exp's last bit, can tip a rounding)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        return
    got, expected = got.float(), expected.float()
    step = expected.abs().clamp_min(1e-30) * 2**-7
    assert ((got - expected).abs() <= 2 * step).all()
    assert (got == expected).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64])  # 64 x 576: the threaded case
def test_rms_norm_matches_the_module(native, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5, dtype)
    norm.weight.data = torch.randn(576, generator=gen).to(dtype)
    x, residual = (torch.randn(rows, 576, generator=gen).mul(3).to(dtype) for _ in range(2))

    assert_same_rounding(native.rms_norm(x, norm.weight, norm.eps), norm._norm(x))

    updated = residual.clone()
    out = native.rms_norm(x, norm.weight, norm.eps, updated)
    assert_same_rounding(updated, residual + x)  # updated in place
    assert_same_rounding(out, norm._norm(residual + x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 40])
def test_rope_rotates_q_and_k_in_place_within_the_fused_qkv_rows(native, dtype, rows):
    heads, kv_heads, head_dim = 9, 3, 64
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    table = torch.randn(100, head_dim, generator=gen)
    positions = torch.randint(0, 100, (rows,), generator=gen)
    cos, sin = table[positions, None].chunk(2, -1)
    rope = Rope(cos, sin, table, positions)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    expected_q = apply_rope(q.reshape(rows, heads, head_dim), rope)
    expected_k = apply_rope(k.reshape(rows, kv_heads, head_dim), rope)
    expected_v = v.clone()

    native.rope_(qkv, heads + kv_heads, head_dim, table, positions)
    assert_same_rounding(q.reshape(rows, heads, head_dim), expected_q)
    assert_same_rounding(k.reshape(rows, kv_heads, head_dim), expected_k)
    assert torch.equal(v, expected_v)  # V is not touched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 32])
def test_silu_mul_matches_the_mlp(native, dtype, rows):
    gate_up = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(2)).mul(4).to(dtype)
    gate, up = gate_up.chunk(2, -1)
    assert_same_rounding(native.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_at_extreme_gates(native, dtype):
    # exp(-gate) overflows float32 below about -88: SiLU is then -0 or a tiny number, never NaN.
    gate = torch.tensor([-1e4, -200, -100, -90, -88.5, -20, -1e-3, 0, 1e-3, 20, 88.5, 90, 100, 200, 1e4, 3] * 2)
    gate = torch.cat([gate, torch.tensor([-1e4, -90, 1e4])])  # 35 gates: two vectors and a scalar tail
    gate_up = torch.cat([gate, torch.linspace(-2, 2, 35)])[None].to(dtype)
    got = native.silu_mul(gate_up)
    assert not got.isnan().any()
    # Where PyTorch's exp overflows to inf its SiLU is -0; the kernels' may keep a tiny value (~1e-37).
    expected = (F.silu(gate_up[:, :35]) * gate_up[:, 35:]).float()
    torch.testing.assert_close(got.float(), expected, rtol=2**-7, atol=1e-30)


@pytest.mark.parametrize(
    "in_features,out_features,reference",
    # PyTorch's int8 kernel crashes on some odd shapes (rows left from groups of four, columns from whole
    # vectors): those compare with float64.
    [
        (576, 960, "torch"),
        (1536, 576, "torch"),
        (192, 40, "torch"),
        (100, 7, "float64"),
        (33, 9, "float64"),
        (70, 13, "float64"),
    ],
)
def test_int8_linear_matches_pytorchs_int8_kernel(native, in_features, out_features, reference):
    gen = torch.Generator().manual_seed(3)
    qweight = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    scales = (torch.rand(out_features, generator=gen) / 50).to(torch.bfloat16)
    x = torch.randn(1, in_features, generator=gen).to(torch.bfloat16)
    if reference == "torch":
        expected = torch.ops.aten._weight_int8pack_mm(x, qweight, scales).double()
    else:
        expected = x.double() @ (qweight.double() * scales.double()[:, None]).T
    got = native.int8_linear(x, qweight, scales)
    assert got.dtype == torch.bfloat16 and got.shape == (1, out_features)
    # Both sum in float32 and round once to bfloat16; the order of the sums differs.
    torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


# Odd shapes: rows left over from groups of four, columns from whole vectors.
@pytest.mark.parametrize("in_features,out_features", [(576, 960), (1536, 576), (100, 7), (33, 9)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_matches_the_linear_layer(native, in_features, out_features, with_bias, dtype):
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(1, in_features, generator=gen).to(dtype)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    got = native.gemv(x, weight, bias)
    assert got.dtype == dtype and got.shape == (1, out_features)
    if dtype == torch.bfloat16:  # float32 sums rounded once to bfloat16
        torch.testing.assert_close(got.double(), expected, rtol=8e-3, atol=1e-3 * expected.abs().max().item())
    else:  # float32 sums in another order than float64's
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("rows", [2, 3, 5, 7, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_of_several_rows_sums_each_as_when_it_comes_alone(native, rows, dtype):
    """Read once for all the rows (blocks of three, then two, then one), each row's sums are bit for bit the
    one-row call's: a speculative step's verified rows keep plain decoding's greedy output."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(37, 100, generator=gen).to(dtype)  # a group of four left over, and a tail of K
    bias = torch.randn(37, generator=gen).to(dtype)
    x = torch.randn(rows, 100, generator=gen).to(dtype)
    got = native.gemv(x, weight, bias)
    assert got.shape == (rows, 37) and got.dtype == dtype
    assert torch.equal(got, torch.cat([native.gemv(x[i : i + 1], weight, bias) for i in range(rows)]))
    expected = F.linear(x.double(), weight.double(), bias.double())
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_stores_strided_rows_at_their_slots(native, dtype):
    gen = torch.Generator().manual_seed(6)
    qkv = torch.randn(5, (4 + 2 * 2) * 8, generator=gen).to(dtype)  # 4 q heads, 2 KV heads of 8: k, v are views
    _, key, value = qkv.split([32, 16, 16], -1)
    key, value = key.view(5, 2, 8), value.view(5, 2, 8)
    slots = torch.tensor([9, 0, 14, 3, 10])
    cache = torch.randn(2, 4, 4, 2, 8, generator=gen).to(dtype)
    expected = cache.clone()
    expected[0].view(-1, 2, 8)[slots] = key
    expected[1].view(-1, 2, 8)[slots] = value
    native.write_kv(cache, key, value, slots)
    assert torch.equal(cache, expected)  # a copy: every other slot untouched
    with pytest.raises(ValueError, match="dtype"):
        native.write_kv(cache, key.double(), value.double(), slots)
    with pytest.raises(ValueError, match="heads must be contiguous"):
        native.write_kv(cache, key.transpose(0, 1).contiguous().transpose(0, 1), value, slots)


@pytest.mark.parametrize("vocab", [1, 15, 40, 49152, 151936])
def test_log_softmax_stats_is_log_softmax_without_writing_it(native, vocab):
    gen = torch.Generator().manual_seed(vocab)
    wide = torch.randn(6, vocab + 9, generator=gen).mul(5)
    x = wide[:, :vocab]  # rows vocab + 9 apart: the kernel reads any row stride
    x[1, vocab // 2] = float("nan")  # a NaN row: NaN, at the first NaN, as torch.max and log_softmax say
    x[1, vocab - 1] = float("nan")
    x[2, vocab // 3] = float("inf")
    x[3] = float("-inf")
    x[4, -1] = x[4].max() + 1  # the largest in the scalar tail
    x[5, : vocab // 2] = float("-inf")  # -inf among finite values: exp(-inf) is 0, not NaN
    largest, index, logsum = native.log_softmax_stats(x)
    expected_max, expected_index = x.max(dim=-1)
    assert torch.equal(index, expected_index)
    torch.testing.assert_close(largest, expected_max, equal_nan=True, rtol=0, atol=0)
    # Against the log-softmax in float64: PyTorch's own in float32 is 3e-5 off at 151936 on some CPUs (AVX2).
    exact = torch.log_softmax(x.double(), dim=-1).float()
    torch.testing.assert_close(x - largest[:, None] - logsum[:, None], exact, equal_nan=True)
    assert logsum[1:4].isnan().all() and not logsum[[0, 4, 5]].isnan().any()


def test_log_softmax_stats_finds_the_first_of_tied_maxima(native):
    x = torch.zeros(3, 100)
    x[0, [17, 50, 99]] = 2.0
    x[1, [96, 97]] = 3.0  # in the tail past the last full vector of 16
    x[2, [0, 5]] = float("inf")
    assert native.log_softmax_stats(x)[1].tolist() == [17, 96, 0]
