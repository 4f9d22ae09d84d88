"""servelm's kernels as PyTorch ops: every argument checked before C reads it, and each op named in
``torch.profiler``.

Where an op writes in place, a rejected call must leave its output as it was: the check ran before the
kernel, not after it.
"""

from __future__ import annotations

import pytest
import torch

from servelm.kernels import build
from servelm.models.packed import rows_alike

OPS = [
    "decode_attention",
    "prefill_attention",
    "write_kv",
    "rms_norm",
    "rope_",
    "silu_mul",
    "log_softmax_stats",
    "draw",
    "top_values",
    "int8_linear",
    "gemv",
    "pack_pairs",
    "gemm_pairs",
    "decode_step",
]


def _draw_args(rows: int) -> tuple[torch.Tensor, ...]:
    """draw's scale, top_k, top_p, min_p and u for ``rows`` rows that take no truncation."""
    return torch.ones(rows), torch.zeros(rows, dtype=torch.long), torch.ones(rows), torch.zeros(rows), torch.zeros(rows)


@pytest.fixture
def native(native_kernels):
    """A short name for the tests below."""
    return native_kernels


def test_each_op_has_a_schema(native):
    for name in OPS:
        schema = str(getattr(torch.ops.servelm, name).default._schema)
        assert schema.startswith(f"servelm::{name}(")
    with pytest.raises((RuntimeError, TypeError), match="gate_up"):
        native.silu_mul([1.0, 2.0])  # a list is not a Tensor: the schema says so before any kernel runs


def test_rejects_inputs_it_cannot_read(native):
    cache = torch.zeros(2, 4, 4, 2, 8)
    query = torch.zeros(1, 4, 8)
    tables, lens = torch.tensor([[0, 1]]), torch.tensor([5])
    assert native.supports(query, cache)
    assert not native.supports(query.half(), cache.half())
    assert not native.supports(query.bfloat16(), cache)
    with pytest.raises(ValueError, match="contiguous"):
        native.decode_attention(query, cache.transpose(3, 4).contiguous().transpose(3, 4), tables, lens, 1.0)
    with pytest.raises(ValueError, match="int64"):
        native.decode_attention(query, cache, tables.int(), lens, 1.0)
    with pytest.raises(ValueError, match="shapes"):
        native.decode_attention(torch.zeros(1, 3, 8), cache, tables, lens, 1.0)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError, match="shapes"):
        native.decode_attention(query, cache, tables, torch.tensor([5, 5]), 1.0)
    x = torch.zeros(4, 16)
    with pytest.raises(ValueError, match="contiguous"):
        native.rms_norm(x.t(), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="one shape"):
        native.rms_norm(x, torch.ones(16), 1e-5, torch.zeros(4, 8))
    with pytest.raises(ValueError, match="float32"):
        native.rope_(x, 2, 8, torch.zeros(10, 8, dtype=torch.float64), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="positions"):
        native.rope_(x, 2, 8, torch.zeros(10, 8), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="even"):
        native.silu_mul(torch.zeros(2, 7))
    for logits in (torch.zeros(2, 0), torch.zeros(2, 8).t(), torch.zeros(2, 8).bfloat16(), torch.zeros(8)):
        with pytest.raises(ValueError, match="float32"):
            native.log_softmax_stats(logits)
        with pytest.raises(ValueError, match="float32"):
            native.draw(logits, *_draw_args(2))
    for bad in range(5):  # each of scale, top_k, top_p, min_p and u of the wrong length, then dtype
        for change in (lambda t: t[:1], lambda t: t.double() if t.dtype == torch.float32 else t.int()):
            args = list(_draw_args(2))
            args[bad] = change(args[bad])
            with pytest.raises(ValueError, match="top_k int64"):
                native.draw(torch.zeros(2, 8), *args)
    with pytest.raises(ValueError, match="k must be"):
        native.top_values(torch.zeros(2, 8), torch.tensor([0]), 9)
    for rows in (torch.tensor([2]), torch.tensor([-1]), torch.tensor([0]).int()):
        with pytest.raises(ValueError, match="rows"):
            native.top_values(torch.zeros(2, 8), rows, 3)
    pairs = torch.zeros(32 * 16, dtype=torch.bfloat16)  # a [32, 16] weight in the pair layout
    with pytest.raises(ValueError, match="agreeing shapes"):
        native.gemm_pairs(torch.zeros(2, 8, dtype=torch.bfloat16), pairs, 32)
    with pytest.raises(ValueError, match="bias"):
        native.gemm_pairs(torch.zeros(2, 16, dtype=torch.bfloat16), pairs, 32, torch.zeros(16, dtype=torch.bfloat16))
    if native.pack_pairs(torch.zeros(32, 16, dtype=torch.bfloat16)) is None:  # well-formed, on a CPU without it
        with pytest.raises(ValueError, match="no AVX512-BF16"):
            native.gemm_pairs(torch.zeros(2, 16, dtype=torch.bfloat16), pairs, 32)
    assert native.pack_pairs(torch.zeros(32, 16)) is None  # float32: no pair layout
    qweight, scales = torch.zeros(3, 16, dtype=torch.int8), torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one bfloat16 row"):
        native.int8_linear(x.bfloat16(), qweight, scales)  # four rows
    with pytest.raises(ValueError, match="one bfloat16 row"):
        native.int8_linear(x[:1], qweight, scales)  # float32
    with pytest.raises(ValueError, match="shapes"):
        native.int8_linear(torch.zeros(1, 8, dtype=torch.bfloat16), qweight, scales)
    weight = torch.zeros(3, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="must be rows"):
        native.gemv(x[0].bfloat16(), weight)  # one dimension
    with pytest.raises(ValueError, match="of its dtype"):
        native.gemv(x[:1], weight)  # float32 x, bfloat16 weight
    with pytest.raises(ValueError, match="of x's dtype"):
        native.gemv(x[:1], weight.float(), torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="shapes"):
        native.gemv(x[:1].bfloat16(), weight.t().contiguous().t())  # not contiguous
    with pytest.raises(ValueError, match="shapes"):
        native.gemv(x[:1].bfloat16(), weight, torch.zeros(4, dtype=torch.bfloat16))


def test_out_of_range_indices_are_refused_before_the_kernel_writes(native):
    cache = torch.randn(2, 4, 4, 2, 8)  # 4 blocks of 4 slots
    before = cache.clone()
    key = value = torch.ones(2, 2, 8)
    for slots in (torch.tensor([3, 16]), torch.tensor([-1, 0])):
        with pytest.raises(ValueError, match="slot"):
            native.write_kv(cache, key, value, slots)
    assert torch.equal(cache, before)

    qkv = torch.randn(2, 4 * 8)
    rotated = qkv.clone()
    with pytest.raises(ValueError, match="position 10 is past"):
        native.rope_(rotated, 4, 8, torch.zeros(10, 8), torch.tensor([0, 10]))
    assert torch.equal(rotated, qkv)

    query = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match="lens"):
        native.decode_attention(query, cache, torch.tensor([[0, 1]]), torch.tensor([9]), 1.0)  # 2 blocks: 8 slots
    with pytest.raises(ValueError, match="block table entry 4"):
        native.decode_attention(query, cache, torch.tensor([[0, 4]]), torch.tensor([5]), 1.0)

    prefill_query = torch.randn(3, 4, 64).bfloat16()
    big_cache = torch.randn(2, 4, 4, 2, 64).bfloat16()
    out = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    tables = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="do not fit"):  # 4 new rows, but the query has 3
        native.prefill_attention(prefill_query, big_cache, tables, torch.tensor([[0], [4], [4]]), 1.0, out)
    with pytest.raises(ValueError, match="block table entry 7"):
        native.prefill_attention(
            prefill_query, big_cache, torch.tensor([[0, 7]]), torch.tensor([[0], [3], [6]]), 1.0, out
        )
    assert not out.any()


def test_a_tensor_off_the_cpu_never_reaches_c(native):
    x = torch.zeros(2, 8)
    with pytest.raises((NotImplementedError, ValueError)):  # the dispatcher finds no kernel, or the op refuses
        native.silu_mul(x.to("meta"))
    with pytest.raises((NotImplementedError, ValueError)):
        native.rms_norm(x, torch.ones(8, device="meta"), 1e-5)


def test_the_small_gemm_refuses_widths_its_layout_cannot_hold(native):
    x = torch.zeros(2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="agreeing shapes"):
        native.gemm_pairs(x, torch.zeros(16 * 16, dtype=torch.bfloat16), 16)  # 16 outputs: not a multiple of 32
    assert native.pack_pairs(torch.zeros(16, 16, dtype=torch.bfloat16)) is None


def test_the_small_gemm_takes_no_rows_and_no_inputs(native):
    """No rows: an empty product; no inputs (K = 0): the bias alone (no division by the pairs of K)."""
    pairs = native.pack_pairs(torch.randn(64, 32).to(torch.bfloat16))
    if pairs is None:
        pytest.skip("no AVX512-BF16: no pair layout")
    assert native.gemm_pairs(torch.zeros(0, 32, dtype=torch.bfloat16), pairs, 64).shape == (0, 64)
    empty = native.pack_pairs(torch.zeros(64, 0, dtype=torch.bfloat16))
    bias = torch.randn(64).to(torch.bfloat16)
    assert torch.equal(native.gemm_pairs(torch.zeros(3, 0, dtype=torch.bfloat16), empty, 64, bias), bias.expand(3, 64))


def test_the_decoding_step_refuses_a_table_naming_no_block_of_its_cache(native, tiny_llama):
    model, _ = tiny_llama("bf16")
    caches = [torch.zeros(2, 8, 4, 2, 16, dtype=torch.bfloat16) for _ in range(3)]  # 8 blocks
    step = model._decoding_step(caches, 1)
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block table entry 8"):
        step(x, torch.tensor([5]), torch.tensor([[0, 8]]))
    with pytest.raises(ValueError, match="past the model's 128"):
        step(x, torch.tensor([128]), torch.arange(8).repeat(5)[None])
    assert torch.equal(x, torch.ones(1, 64, dtype=torch.bfloat16))
    assert not any(c.any() for c in caches)


def test_the_ops_show_by_name_in_the_profiler(native, tiny_llama, paged_runner):
    model, config = tiny_llama("pairs")
    runner = paged_runner(model, config)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        runner.step([("a", [3, 4, 5, 6, 7]), ("b", [8, 9])])  # two prefills
        with rows_alike():  # each row as one row alone: layer by layer
            runner.step([], [("a", 10), ("b", 11)])  # two decodes
        runner.step([], [("a", 12)])  # one decode: the one-call step
    names = {event.key for event in prof.key_averages()}
    expected = {
        "servelm::rms_norm",
        "servelm::rope_",
        "servelm::write_kv",
        "servelm::prefill_attention",
        "servelm::decode_attention",
        "servelm::silu_mul",
        "servelm::decode_step",
    }
    if "avx512_bf16" in build.cpu_flags():
        expected.add("servelm::gemm_pairs")  # the decodes' projections in the pair layout
    assert expected <= names, sorted(n for n in names if n.startswith("servelm::"))
