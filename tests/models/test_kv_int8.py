"""The int8 KV cache (``kv_cache_dtype="int8"``): its rounding, the native kernels that write and read it
against PyTorch over the same rounded values, the PyTorch path, and the engine serving from it."""

from __future__ import annotations

import pytest
import torch

from servelm import kernels
from servelm.engine.config import EngineConfig
from servelm.kernels import reference_decode_attention
from servelm.kernels.self_check import self_check
from servelm.layers.attention import paged_attention
from servelm.layers.kv_int8 import dequantize_rows, quantize_rows
from tests.models.test_attention import PREFILLS_AND_DECODES, dense_reference, make_case

BF16 = torch.bfloat16


def test_rows_round_to_within_half_a_step_and_carry_their_scale():
    x = torch.randn(5, 3, 64) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    x[0, 0] = 0  # a zero row: scale 0, values 0
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 68)
    scales = rows[..., 64:].contiguous().view(torch.float32)[..., 0]
    torch.testing.assert_close(scales, x.abs().amax(-1) / 127)
    assert rows[..., :64].abs().max() == 127  # each nonzero row's largest value is the full step count
    back = dequantize_rows(rows, torch.float32)
    assert back[0, 0].eq(0).all()
    assert ((back - x).abs() <= scales[..., None] / 2 * (1 + 1e-5)).all()


def int8_case(prefills, decodes, num_heads, num_kv_heads, head_dim=64, block_size=16, seed=0):
    """test_attention's case with its cache rounded to int8, and the expectation over the rounded K/V (this
    step's too: the kernels read them back from the cache)."""
    case = make_case(prefills, decodes, num_heads, num_kv_heads, head_dim=head_dim, block_size=block_size, seed=seed)
    case.cache = quantize_rows(case.cache)
    flat = dequantize_rows(case.cache, torch.float32).view(2, -1, num_kv_heads, head_dim)
    flat[0, case.meta.slot_mapping] = dequantize_rows(quantize_rows(case.key.to(BF16)), torch.float32)
    flat[1, case.meta.slot_mapping] = dequantize_rows(quantize_rows(case.value.to(BF16)), torch.float32)
    expected, start = [], 0
    for i, (q_len, ctx) in enumerate(zip(case.meta.query_lens, case.meta.context_lens, strict=True)):
        table = case.meta.block_tables[i]
        slots = [table[t // block_size] * block_size + t % block_size for t in range(ctx)]
        expected.append(dense_reference(case.query[start : start + q_len], flat[0, slots], flat[1, slots], case.scale))
        start += q_len
    case.expected = torch.cat(expected)
    return case


def run_bf16(case) -> torch.Tensor:
    return paged_attention(
        case.query.to(BF16), case.key.to(BF16), case.value.to(BF16), case.cache, case.meta, case.scale
    )


@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 128), (14, 2, 64), (8, 8, 64), (16, 2, 32)]
)
def test_prefills_and_decodes_over_an_int8_cache(cpu_ops, num_heads, num_kv_heads, head_dim, block_size):
    """Both paths (native kernels, and PyTorch's gather + SDPA) at model shapes: fresh prompts, a prompt
    behind a cached prefix, a one-token chunk and decodes, all over the rounded K/V."""
    case = int8_case(*PREFILLS_AND_DECODES, num_heads, num_kv_heads, head_dim, block_size, seed=11)
    # PyTorch's path attends a fresh prompt over its own K/V before rounding: a little further off. The native
    # prefill kernel runs where its int8 decoding does (AVX512-BF16, head dims a multiple of 64).
    native_prefill = cpu_ops == "native" and kernels.cpu_kernels().decodes_int8_cache(head_dim)
    tol = 2e-2 if native_prefill else 5e-2
    torch.testing.assert_close(run_bf16(case).float(), case.expected, atol=tol, rtol=tol)


@pytest.mark.usefixtures("cpu_ops")
def test_this_steps_rows_are_written_rounded_at_their_slots():
    case = int8_case([(9, 4)], [6], 4, 2)
    run_bf16(case)
    flat = case.cache.view(2, -1, *case.cache.shape[-2:])
    for i, fresh in enumerate((case.key, case.value)):
        written = flat[i, case.meta.slot_mapping]
        expected = quantize_rows(fresh.to(BF16))
        # The native rounding may land one step off PyTorch's where a value sits on a half step.
        assert (written[..., :64].int() - expected[..., :64].int()).abs().max() <= 1
        assert torch.equal(written[..., 64:], expected[..., 64:])


@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (14, 2, 64), (8, 8, 128)])
def test_native_decode_reads_the_int8_cache_in_place(native_kernels, num_heads, num_kv_heads, head_dim, threads, amx):
    """The kernel itself, against float64 attention over the dequantized cache: sequences of 1 to 250 tokens,
    fewer sequences than threads (split by KV head), and the AMX and AVX512 score paths."""
    gen = torch.Generator().manual_seed(3)
    cache = quantize_rows(torch.randn(2, 40, 16, num_kv_heads, head_dim, generator=gen))
    tables = torch.stack([torch.randperm(40, generator=gen)[:16] for _ in range(4)])
    lens = torch.tensor([1, 17, 250, 32])
    query = torch.randn(4, num_heads, head_dim, generator=gen).to(BF16)
    was_amx, was_threads = native_kernels.attention_use_amx(), torch.get_num_threads()
    try:
        native_kernels.attention_use_amx(amx)
        torch.set_num_threads(threads)
        got = native_kernels.decode_attention(query, cache, tables, lens, 0.125)
        alone = native_kernels.decode_attention(query[2:3], cache, tables[2:3], lens[2:3], 0.125)
    finally:
        native_kernels.attention_use_amx(was_amx)
        torch.set_num_threads(was_threads)
    if got is None:
        pytest.skip("this CPU has no AVX512-BF16: the int8 cache is read through PyTorch")
    expected = reference_decode_attention(query, dequantize_rows(cache, torch.float64), tables, lens, 0.125)
    torch.testing.assert_close(got.double(), expected, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(alone.double(), expected[2:3], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("length", [1, 511, 512, 1025, 2047])
def test_native_decode_sums_long_contexts_of_extreme_values_exactly_enough(native_kernels, length):
    """Every value at the int8 extreme (127, or -127) over contexts past the kernel's int32 sums' flush
    (512 keys): a query that weighs every key alike (keys all zero) averages them (all 127 on KV head 0, the
    sums' largest), and one key with a large score takes nearly all the weight."""
    gen = torch.Generator().manual_seed(5)
    blocks = -(-length // 16)
    values = torch.where(torch.rand(2, blocks, 16, 2, 64, generator=gen) < 0.5, -1.0, 1.0)
    values[1, ..., 0, :] = 1.0  # KV head 0's values all alike: their sums grow as far as they can
    values[0] = 0.0  # keys
    values[0, 0, 3, :, 0] = 1.0  # key 3's first dim: a large score for a query along it
    cache = quantize_rows(values)
    tables, lens = torch.randperm(blocks, generator=gen)[None], torch.tensor([length])
    query = torch.zeros(1, 6, 64, dtype=BF16)
    query[0, 3:, 0] = 40.0  # query heads 3..5 (KV head 1) pick key 3 where it is among the keys
    got = native_kernels.decode_attention(query, cache, tables, lens, 1.0)
    if got is None:
        pytest.skip("this CPU has no AVX512-BF16: the int8 cache is read through PyTorch")
    expected = reference_decode_attention(query, dequantize_rows(cache, torch.float64), tables, lens, 1.0)
    torch.testing.assert_close(got.double(), expected, atol=2e-3, rtol=1e-2)


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_long_sequence_decodes_alike_alone_and_beside_others(native_kernels, cache_dtype, threads):
    """Sequences past the native kernel's parts (512 keys: their keys split between the threads, the parts
    merged by their softmax sums) get the same attention to the last bit alone as beside others, over a
    bfloat16 or an int8 cache: a speculative step's verified rows decode beside each other and must come out
    as plain decoding's one row does. And it is attention: against float64 over the same cache."""
    gen = torch.Generator().manual_seed(11)
    cache = torch.randn(2, 200, 16, 2, 64, generator=gen).to(torch.bfloat16)
    cache = quantize_rows(cache) if cache_dtype == "int8" else cache
    tables = torch.stack([torch.randperm(200, generator=gen)[:100] for _ in range(4)])
    lens = torch.tensor([1500, 20, 1599, 513])
    query = torch.randn(4, 14, 64, generator=gen).to(torch.bfloat16)
    was = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        together = native_kernels.decode_attention(query, cache, tables, lens, 0.125)
        alone = [
            native_kernels.decode_attention(query[i : i + 1], cache, tables[i : i + 1], lens[i : i + 1], 0.125)
            for i in range(4)
        ]
    finally:
        torch.set_num_threads(was)
    if together is None:
        pytest.skip("this CPU has no AVX512-BF16: the int8 cache is read through PyTorch")
    for i, one in enumerate(alone):
        assert torch.equal(one[0], together[i]), f"sequence {i} ({lens[i].item()} keys) alone differs"
    values = dequantize_rows(cache, torch.float64) if cache_dtype == "int8" else cache.double()
    expected = reference_decode_attention(query, values, tables, lens, 0.125)
    torch.testing.assert_close(together.double(), expected, atol=1e-2, rtol=1e-2)


def test_the_ops_check_an_int8_cache(native_kernels):
    cache = torch.zeros(2, 4, 16, 2, 68, dtype=torch.int8)
    tables, lens = torch.tensor([[0, 1]]), torch.tensor([20])
    query = torch.randn(1, 4, 64).to(BF16)
    with pytest.raises(ValueError, match="shapes disagree"):  # 68 bytes are 64 values: not 68
        native_kernels.decode_attention(torch.randn(1, 4, 68).to(BF16), cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="shapes disagree"):
        native_kernels.write_kv(cache, query[:, :2, :60], query[:, :2, :60], torch.tensor([0]))
    with pytest.raises(ValueError, match="head_dim"):
        native_kernels.decode_attention(query, torch.zeros(2, 4, 16, 2, 4, dtype=torch.int8), tables, lens, 1.0)
    # float32 queries are PyTorch's to run over an int8 cache: no kernel result, and no kernels for the layer
    assert native_kernels.decode_attention(query.float(), cache, tables, lens, 1.0) is None
    assert kernels.for_cache(query.float(), cache) is None
    assert kernels.for_cache(query, cache) is kernels.cpu_kernels()


@pytest.mark.parametrize("broken", ["decode_attention", "prefill_attention", "write_kv"])
def test_the_load_time_self_check_rejects_a_wrong_int8_kernel(native_kernels, broken):
    if (
        native_kernels.decode_attention(
            torch.zeros(1, 2, 64, dtype=BF16),
            torch.zeros(2, 1, 16, 1, 68, dtype=torch.int8),
            torch.tensor([[0]]),
            torch.tensor([1]),
            1.0,
        )
        is None
    ):
        pytest.skip("this CPU has no AVX512-BF16: the int8 cache's kernels do not run, nothing to check")

    class Miscompiled(kernels.CpuKernels):
        pass

    real = getattr(native_kernels, broken)

    def wrong_over_int8(self, *args):
        result = real(*args)
        if args[broken != "write_kv"].dtype == torch.int8:  # the cache: write_kv's first argument, else second
            if broken == "write_kv":
                args[0].zero_()
            elif broken == "prefill_attention":
                args[-1].zero_()
            else:
                result.zero_()
        return result

    setattr(Miscompiled, broken, wrong_over_int8)
    with pytest.raises(RuntimeError, match=f"{broken} over an int8 cache differs"):
        self_check(Miscompiled())


def test_engine_config_names_the_cache_dtypes():
    assert EngineConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8"):
        EngineConfig(kv_cache_dtype="fp8")


@pytest.fixture(scope="module")
def greedy_pair(model_path):
    """The bundled model's greedy completions of a few prompts (with each token's five likeliest), batched and
    one at a time (the one-call decoder's path where the cache is bfloat16), with a bfloat16 cache and with an
    int8 one."""
    from servelm import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "The three primary colors are"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    runs = {}
    for kv in ("auto", "int8"):
        llm = LLM(str(model_path), dtype="bfloat16", device="cpu", kv_cache_memory=64 << 20, kv_cache_dtype=kv)
        batched = [o.outputs[0] for o in llm.generate(prompts, params)]
        alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts[:2]]
        runs[kv] = (llm.engine.runner, batched, alone)
    return runs


def test_engine_serves_from_an_int8_cache_of_twice_the_tokens(greedy_pair):
    """The same memory holds about twice the tokens ((64 + 4) bytes a row against 128), and greedy text stays
    the bfloat16 cache's until int8 rounding flips a near tie, after which this small model's text forks
    (docs/BENCHMARKS.md measures the agreement and perplexity). How many of the tokens agree depends on where
    the forks fall, which moves with the CPU's arithmetic (69 of these 96 on AVX-512 CPUs, 56 on an AVX2 one):
    each fork is checked to be at a near tie instead."""
    (bf16_runner, bf16_batched, bf16_alone), (int8_runner, int8_batched, int8_alone) = (
        greedy_pair["auto"],
        greedy_pair["int8"],
    )
    assert int8_runner.kv_caches[0].dtype == torch.int8
    assert int8_runner.num_blocks == pytest.approx(bf16_runner.num_blocks * 128 / 68, rel=0.01)
    for exact, rounded in zip(bf16_batched, int8_batched, strict=True):
        fork = next((i for i, (x, y) in enumerate(zip(exact.token_ids, rounded.token_ids)) if x != y), None)
        if fork is None:
            continue
        # The bfloat16 cache's five likeliest there: the int8 cache's choice among them, within three steps of
        # bfloat16 logits of this size (0.125 each) of the likeliest. At the forks seen: 0 and 0.125 on AVX-512,
        # 0.25 on a Zen 1 with AVX2 (three tokens 0.125 apart).
        likeliest = {t.token_id: t.logprob for t in exact.logprobs[fork].top}
        assert rounded.token_ids[fork] in likeliest
        assert likeliest[exact.token_ids[fork]] - likeliest[rounded.token_ids[fork]] <= 0.375
    assert int8_batched[0].token_ids[:3] == bf16_batched[0].token_ids[:3]  # " Paris" and what follows it
    # One sequence alone decodes over the int8 cache too (in one native call where its kernel runs).
    assert [len(t) for t in int8_alone] == [24, 24]
    assert int8_alone[0][:3] == bf16_alone[0][:3]
