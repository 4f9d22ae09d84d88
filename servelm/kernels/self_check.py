"""The load-time self-check: each op of a freshly loaded build against plain PyTorch on small cases.

A build is used only once it passes (``servelm.kernels.cpu_kernels``): a
miscompiled kernel then costs speed (the PyTorch path runs), never wrong
text. ``reference_decode_attention`` is also bench/kernels.py's expectation.
"""

from __future__ import annotations

import torch

from servelm.kernels.ops import CpuKernels


def reference_decode_attention(query, kv_cache, block_tables, lens, scale):
    """Decode attention in float64 PyTorch: the self-check's expectation, and bench/kernels.py's."""
    block_size = kv_cache.shape[2]
    group = query.shape[1] // kv_cache.shape[3]
    flat = kv_cache.flatten(1, 2).double()
    outs = []
    for b, n in enumerate(lens.tolist()):
        slots = [block_tables[b, t // block_size] * block_size + t % block_size for t in range(n)]
        k = flat[0, slots].repeat_interleave(group, 1)  # [n, H, D]
        v = flat[1, slots].repeat_interleave(group, 1)
        weights = (torch.einsum("hd,nhd->hn", query[b].double(), k) * scale).softmax(-1)
        outs.append(torch.einsum("hn,nhd->hd", weights, v))
    return torch.stack(outs)


def self_check(kernels: CpuKernels) -> None:
    """Each kernel against plain PyTorch on a small case, in both dtypes; RuntimeError on a mismatch."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 6, 4, 2, 16, generator=gen)
    tables, lens = torch.tensor([[5, 1, 3], [0, 2, 4]]), torch.tensor([11, 3])
    query = torch.randn(2, 6, 16, generator=gen)
    x, res, w = torch.randn(3, 40, generator=gen), torch.randn(3, 40, generator=gen), torch.randn(40, generator=gen)
    cos_sin, positions = torch.randn(9, 8, generator=gen), torch.tensor([4, 0, 8])
    cos, sin = cos_sin[positions, None].chunk(2, -1)
    x1, x2 = x[:, :16].view(3, 2, 8).chunk(2, -1)
    checks = {
        "decode_attention": (
            lambda dt: kernels.decode_attention(query.to(dt), cache.to(dt), tables, lens, 0.25),
            reference_decode_attention(query, cache, tables, lens, 0.25),
        ),
        "rms_norm": (
            lambda dt: kernels.rms_norm(x.to(dt), w.to(dt), 1e-5, res.to(dt).clone()),
            w * (res + x) * torch.rsqrt((res + x).pow(2).mean(-1, keepdim=True) + 1e-5),
        ),
        "rope_": (
            lambda dt: _rotated(kernels, x.to(dt, copy=True), cos_sin, positions),
            torch.cat([torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).view(3, 16), x[:, 16:]], -1),
        ),
        "silu_mul": (lambda dt: kernels.silu_mul(x.to(dt)), torch.nn.functional.silu(x[:, :20]) * x[:, 20:]),
        "write_kv": (  # rows 0 and 1 of x as three tokens' K and V heads, into slots 5, 0, 2 of a zero cache
            lambda dt: _written(kernels, x.to(dt), torch.tensor([5, 0, 2])),
            torch.zeros(2, 6, 16).index_copy_(1, torch.tensor([5, 0, 2]), x[:, :32].view(3, 2, 16).transpose(0, 1)),
        ),
    }
    logits = torch.cat([x, x * 30])  # 6 rows of 40: two vectors' worth each, with a tail
    checks["log_softmax_stats"] = (
        lambda dt: _log_softmax_of(kernels, logits),
        torch.log_softmax(logits, dim=-1),
    )
    qweight = torch.randint(-127, 128, (12, 40), generator=gen, dtype=torch.int8)
    scales = torch.rand(12, generator=gen).to(torch.bfloat16)
    row = x[:1].to(torch.bfloat16)
    int8_expected = row.double() @ (qweight.double() * scales.double()[:, None]).T
    checks["int8_linear"] = (lambda dt: kernels.int8_linear(row, qweight, scales), int8_expected)
    weight, bias = (qweight.double() * scales.double()[:, None]).to(torch.bfloat16), res[0, :12].to(torch.bfloat16)
    rows = x.to(torch.bfloat16)  # three rows, each summed as when it comes alone (_check_gemv_rows_alike)
    gemv_expected = rows.double() @ weight.double().T + bias.double()
    checks["gemv"] = (lambda dt: kernels.gemv(rows.to(dt), weight.to(dt), bias.to(dt)), gemv_expected)
    _check_gemv_rows_alike(kernels, rows, weight, bias)
    wide = torch.cat([weight, weight.flip(0), weight[:8]])  # 32 outputs: one block pair of the pair layout
    pairs = kernels.pack_pairs(wide)
    if pairs is not None:
        rows, wide_bias = x.to(torch.bfloat16), torch.cat([bias, bias, bias[:8]])
        pairs_expected = rows.double() @ wide.double().T + wide_bias.double()
        checks["gemm_pairs"] = (lambda dt: kernels.gemm_pairs(rows, pairs, 32, wide_bias), pairs_expected)
        if kernels.pairs_amx(64):  # the tile unit's rows of 32 of K: 64 inputs, the 40 and 24 of them again
            wide64, rows64 = torch.cat([wide, wide[:, :24]], 1), torch.cat([rows, rows[:, :24]], 1)
            pairs64 = kernels.pack_pairs(wide64)
            amx_expected = rows64.double() @ wide64.double().T + wide_bias.double()
            checks["gemm_pairs_amx"] = (
                lambda dt: kernels.gemm_pairs(rows64, pairs64, 32, wide_bias, amx=True),
                amx_expected,
            )
    packed = kernels.w8a8_pack(qweight)
    if packed is not None:  # rows quantized as the kernel does (max |row| / 127), int8 sums exact
        xb, w8a8_bias = x.bfloat16().float(), res[0, :12].bfloat16().float()  # the same values in both dtypes
        top = xb.abs().amax(1, keepdim=True)
        q = torch.round(xb * (torch.full_like(top, 127.0) / top)).clamp(-127, 127)  # 127.0 / top: 127 * (1 / top)
        w8a8_expected = (q.double() @ qweight.double().T) * (top.double() / 127) * scales.double() + w8a8_bias.double()
        checks["w8a8_linear"] = (
            lambda dt: kernels.w8a8_linear(xb.to(dt), packed, scales.float(), 12, w8a8_bias.to(dt)),
            w8a8_expected,
        )
    _check_prefill(kernels, gen)
    for name, (run, expected) in checks.items():
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
            if name in ("int8_linear", "gemm_pairs", "gemm_pairs_amx") or (name, dtype) == ("gemv", torch.bfloat16):
                tol = 1e-2  # bfloat16 in and out whatever the model's dtype (gemv: in bfloat16)
            if name == "log_softmax_stats":
                tol = 1e-5  # float32 logits whatever the model's dtype
            got = run(dtype).double()
            if got.shape != expected.shape:
                raise RuntimeError(f"{name} in {dtype} differs from PyTorch's in shape: {tuple(got.shape)}")
            if not torch.allclose(got, expected.double(), atol=tol, rtol=tol):
                raise RuntimeError(f"{name} in {dtype} differs from PyTorch's by {(got - expected).abs().max():.3g}")
    _check_int8_cache(kernels, gen)


def _check_gemv_rows_alike(kernels: CpuKernels, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
    """gemv sums each of several rows bit for bit as it sums that row alone: a speculative step's verified rows
    rely on it for plain decoding's greedy output (models/packed.py)."""
    for dtype in (torch.float32, torch.bfloat16):
        x, w, b = rows.to(dtype), weight.to(dtype), bias.to(dtype)
        alone = torch.cat([kernels.gemv(x[i : i + 1], w, b) for i in range(x.shape[0])])
        if not torch.equal(kernels.gemv(x, w, b), alone):
            raise RuntimeError(f"gemv in {dtype} sums a row among others differently from that row alone")


def _check_prefill(kernels: CpuKernels, gen: torch.Generator) -> None:
    """The prefill kernel where it applies (bfloat16, 64-dim heads): token i of a sequence's new tokens attends
    like a decoding token at position ``context - new + i``."""
    cache = torch.randn(2, 6, 4, 2, 64, generator=gen).to(torch.bfloat16)
    tables = torch.tensor([[5, 1, 3], [0, 2, 4]])
    seq_lens = torch.tensor([[0, 5], [5, 2], [11, 3]])  # first rows, new tokens, contexts: 5 of 11, 2 of 3
    query = torch.randn(7, 6, 64, generator=gen).to(torch.bfloat16)
    out = query.new_zeros(query.shape)
    if not kernels.prefill_attention(query, cache, tables, seq_lens, 0.125, out):
        return
    token_tables, token_lens = tables[[0] * 5 + [1] * 2], torch.tensor([7, 8, 9, 10, 11, 2, 3])
    expected = reference_decode_attention(query, cache, token_tables, token_lens, 0.125)
    if not torch.allclose(out.double(), expected, atol=3e-2, rtol=3e-2):
        error = (out.double() - expected).abs().max()
        raise RuntimeError(f"prefill_attention in torch.bfloat16 differs from PyTorch's by {error:.3g}")


def _check_int8_cache(kernels: CpuKernels, gen: torch.Generator) -> None:
    """The int8 cache's kernels where they run (bfloat16 queries, 64-dim heads): rows written as PyTorch
    rounds them (to a step), decode and prefill attention over them."""
    from servelm.layers.kv_int8 import dequantize_rows, quantize_rows  # layers import kernels: not at the top

    cache = quantize_rows(torch.randn(2, 6, 4, 2, 64, generator=gen))
    tables, lens = torch.tensor([[5, 1, 3], [0, 2, 4]]), torch.tensor([11, 3])
    query = torch.randn(2, 6, 64, generator=gen).to(torch.bfloat16)
    got = kernels.decode_attention(query, cache, tables, lens, 0.125)
    if got is None:
        return
    values = dequantize_rows(cache, torch.float64)
    expected = reference_decode_attention(query, values, tables, lens, 0.125)
    out = query.new_zeros(3, 6, 64)
    kernels.prefill_attention(
        query[:1, :, :].expand(3, 6, 64), cache, tables[:1], torch.tensor([[0], [3], [11]]), 0.125, out
    )
    prefill_expected = reference_decode_attention(
        query[:1].expand(3, 6, 64), values, tables[[0, 0, 0]], torch.tensor([9, 10, 11]), 0.125
    )
    written = torch.zeros_like(cache)
    key = torch.randn(3, 2, 64, generator=gen).to(torch.bfloat16)
    kernels.write_kv(written, key, key, torch.tensor([5, 0, 2]))
    rounded = written.view(2, -1, 2, 68)[0, [5, 0, 2]]
    for name, result, expect, tol in (
        ("decode_attention", got, expected, 3e-2),
        ("prefill_attention", out, prefill_expected, 3e-2),
        ("write_kv", dequantize_rows(rounded, torch.float64), dequantize_rows(quantize_rows(key), torch.float64), 3e-2),
    ):
        if not torch.allclose(result.double(), expect.double(), atol=tol, rtol=tol):
            error = (result.double() - expect.double()).abs().max()
            raise RuntimeError(f"{name} over an int8 cache differs from PyTorch's by {error:.3g}")


def _log_softmax_of(kernels: CpuKernels, logits: torch.Tensor) -> torch.Tensor:
    largest, index, logsum = kernels.log_softmax_stats(logits)
    if not torch.equal(index, logits.argmax(dim=-1)):
        raise RuntimeError("log_softmax_stats in torch.float32 differs from PyTorch's argmax")
    return logits - largest[:, None] - logsum[:, None]


def _written(kernels: CpuKernels, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    cache = x.new_zeros(2, 3, 2, 1, 16)  # 6 slots of one 16-dim head
    kernels.write_kv(cache, x[:, :16].view(3, 1, 16), x[:, 16:32].view(3, 1, 16), slots)
    return cache.view(2, 6, 16)


def _rotated(kernels: CpuKernels, x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    kernels.rope_(x, 2, 8, cos_sin, positions)
    return x
