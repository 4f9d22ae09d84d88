"""Paged attention against a dense per-sequence reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from servelm.kernels import build
from servelm.layers.attention import AttentionMetadata, paged_attention

# Every test runs with the native CPU decode kernel and with the PyTorch (gather + SDPA) path.
pytestmark = pytest.mark.usefixtures("cpu_ops")


def dense_reference(q, k, v, scale):
    """q ``[q_len, H, D]`` at the end of a context whose full K/V are ``[ctx, KVH, D]``."""
    q_len, num_heads, _ = q.shape
    ctx = k.shape[0]
    group = num_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    query_pos = torch.arange(ctx - q_len, ctx)[:, None]
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


@dataclass
class Case:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    cache: torch.Tensor
    meta: AttentionMetadata
    expected: torch.Tensor
    scale: float

    def run(self) -> torch.Tensor:
        return paged_attention(self.query, self.key, self.value, self.cache, self.meta, self.scale)


def make_case(prefills, decodes, num_heads, num_kv_heads, head_dim=16, block_size=4, seed=0, precompute=True):
    """``prefills``: (context_len, query_len) per prefill; ``decodes``: context_len per decode."""
    seqs = list(prefills) + [(ctx, 1) for ctx in decodes]
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    # Random, disjoint block tables, so a wrong table lookup reads another sequence's data.
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [order[sum(blocks_per_seq[:i]) : sum(blocks_per_seq[: i + 1])] for i in range(len(seqs))]
    max_blocks = max(blocks_per_seq)
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    flat_cache = cache.view(2, -1, num_kv_heads, head_dim)
    scale = head_dim**-0.5

    qs, ks, vs, slots, expected = [], [], [], [], []
    for (ctx, q_len), table in zip(seqs, tables):
        full_k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
        full_v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
        seq_slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(ctx)])
        # The prefix is already cached (earlier chunks / prefix cache); the last q_len tokens are this step's.
        cached = ctx - q_len
        flat_cache[0, seq_slots[:cached]] = full_k[:cached]
        flat_cache[1, seq_slots[:cached]] = full_v[:cached]
        q = torch.randn(q_len, num_heads, head_dim, generator=gen)
        qs.append(q)
        ks.append(full_k[cached:])
        vs.append(full_v[cached:])
        slots.append(seq_slots[cached:])
        expected.append(dense_reference(q, full_k, full_v, scale))

    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_lens=[q_len for _, q_len in seqs],
        context_lens=[ctx for ctx, _ in seqs],
        block_tables=block_tables,
        num_prefills=len(prefills),
        num_prefill_tokens=sum(q_len for _, q_len in prefills),
        decode_lens=torch.tensor(list(decodes)) if precompute and decodes else None,
    )
    return Case(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, torch.cat(expected), scale)


CASES = {
    "fresh prefill": ([(7, 7)], []),
    "chunked prefill": ([(13, 5)], []),
    "fresh and chunked prefills": ([(9, 9), (20, 3), (4, 4)], []),
    "decodes only": ([], [5, 17, 1, 8]),
    "one decode": ([], [13]),  # fewer sequences than threads: the native kernel splits by head
    "mixed prefill and decode": ([(6, 6), (11, 4)], [3, 16, 9]),
    "one-token chunk then decodes": ([(10, 1)], [2, 12]),
}


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("name", CASES)
def test_matches_dense_reference(name, num_heads, num_kv_heads):
    case = make_case(*CASES[name], num_heads, num_kv_heads)
    torch.testing.assert_close(case.run(), case.expected, atol=1e-5, rtol=1e-5)


def test_decode_lens_computed_when_not_precomputed():
    case = make_case([(5, 5)], [12, 7], 4, 2, precompute=False)
    torch.testing.assert_close(case.run(), case.expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_block_sizes(block_size):
    case = make_case([(19, 6)], [33, 2], 4, 2, block_size=block_size, seed=3)
    torch.testing.assert_close(case.run(), case.expected, atol=1e-5, rtol=1e-5)


def test_stale_nan_past_the_context_does_not_leak_in():
    """A freed block's old contents stay in its unused slots; a NaN left there must not reach the output."""
    case = make_case([(13, 5), (6, 2)], [7, 3], 4, 2)  # 13, 6, 7, 3 tokens: the last blocks have stale slots
    flat = case.cache.view(2, -1, *case.cache.shape[-2:])
    for i, ctx in enumerate(case.meta.context_lens):
        table = case.meta.block_tables[i]
        stale = [table[t // 4] * 4 + t % 4 for t in range(ctx, -(-ctx // 4) * 4)]
        flat[:, stale] = float("nan")
    out = case.run()
    assert not out.isnan().any()
    torch.testing.assert_close(out, case.expected, atol=1e-5, rtol=1e-5)


def test_new_kv_written_at_slots():
    case = make_case([(9, 4)], [6], 4, 2)
    case.run()
    flat = case.cache.view(2, -1, *case.cache.shape[-2:])
    torch.testing.assert_close(flat[0, case.meta.slot_mapping], case.key)
    torch.testing.assert_close(flat[1, case.meta.slot_mapping], case.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    # SmolLM2, Llama-3-8B's groups of 4, 128-dim heads, 7 query heads per KV head (Qwen2-0.5B), 32-dim heads
    [(9, 3, 64), (32, 8, 128), (8, 8, 128), (14, 2, 64), (16, 2, 32)],
)
@pytest.mark.parametrize(
    "contexts", [[1, 16, 17, 250, 129], [250], [600, 3, 1500], [1300]], ids=["batch", "one", "parts", "one-parts"]
)
def test_long_decodes_at_model_shapes(dtype, num_heads, num_kv_heads, head_dim, contexts):
    """Contexts across many 16-token blocks, at real head shapes, in both cache dtypes; one sequence alone
    (the native kernel then splits it by KV head); contexts past 512 keys, which the native kernel splits
    into parts and merges."""
    case = make_case([], contexts, num_heads, num_kv_heads, head_dim=head_dim, block_size=16, seed=7)
    got = paged_attention(
        case.query.to(dtype), case.key.to(dtype), case.value.to(dtype), case.cache.to(dtype), case.meta, case.scale
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), case.expected, atol=tol, rtol=tol)


def run_bf16(case: Case) -> torch.Tensor:
    bf16 = torch.bfloat16
    return paged_attention(
        case.query.to(bf16), case.key.to(bf16), case.value.to(bf16), case.cache.to(bf16), case.meta, case.scale
    )


# Fresh prompts, a prompt behind a cached prefix (158 of 142 new, as a chat prompt after a cached system
# prompt), a one-token chunk, and decodes after them.
PREFILLS_AND_DECODES = ([(158, 142), (40, 40), (300, 1), (77, 77)], [20, 5])


@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 128), (14, 2, 64), (8, 8, 64), (16, 2, 32)]
)
def test_bf16_prefills_at_model_shapes(num_heads, num_kv_heads, head_dim, block_size):
    """bfloat16 is what the native prefill kernel takes (64-dim multiples; 32-dim heads stay on PyTorch)."""
    case = make_case(*PREFILLS_AND_DECODES, num_heads, num_kv_heads, head_dim=head_dim, block_size=block_size, seed=11)
    torch.testing.assert_close(run_bf16(case).float(), case.expected, atol=2e-2, rtol=2e-2)


def test_bf16_prefill_ignores_stale_nan_past_the_context():
    case = make_case([(158, 142), (21, 21)], [7], 9, 3, head_dim=64, block_size=16, seed=4)
    flat = case.cache.view(2, -1, *case.cache.shape[-2:])
    for i, ctx in enumerate(case.meta.context_lens):
        table = case.meta.block_tables[i]
        flat[:, [table[t // 16] * 16 + t % 16 for t in range(ctx, -(-ctx // 16) * 16)]] = float("nan")
    out = run_bf16(case)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), case.expected, atol=2e-2, rtol=2e-2)


def test_native_prefill_kernel_takes_bf16_where_the_cpu_has_avx512_bf16(cpu_ops, native_kernels, monkeypatch):
    """Guards the tests above: on such a CPU they must exercise the kernel, not PyTorch's path (and with the
    kernels off, nothing calls it)."""
    taken = []
    real = native_kernels.prefill_attention
    monkeypatch.setattr(native_kernels, "prefill_attention", lambda *args: taken.append(real(*args)) or taken[-1])
    case = make_case(*PREFILLS_AND_DECODES, 9, 3, head_dim=64, block_size=16, seed=11)
    torch.testing.assert_close(run_bf16(case).float(), case.expected, atol=2e-2, rtol=2e-2)
    if cpu_ops == "torch":
        assert taken == []
        return
    assert taken == ["avx512_bf16" in build.cpu_flags()]
    case = make_case(*PREFILLS_AND_DECODES, 9, 3, head_dim=64, block_size=16, seed=11)
    case.run()  # float32: PyTorch's path
    assert taken[-1] is False


def test_swapped_block_tables_change_the_result():
    """Guards the reference test itself: reading the wrong blocks must not pass."""
    case = make_case([(12, 2)], [12], 4, 2, seed=5)
    case.meta.block_tables = case.meta.block_tables.flip(0)
    assert not torch.allclose(case.run(), case.expected, atol=1e-3)


# SmolLM2, Qwen2-0.5B's 7 per KV head, 128-dim heads, 32-dim ones, and 20 per KV head (past a tile's 16
# columns: the AVX512-BF16 loop runs with the tiles on too)
AMX_HEAD_SHAPES = [(9, 3, 64), (14, 2, 64), (32, 8, 128), (16, 1, 32), (40, 2, 64)]


def scores_on_and_off(cpu_ops, native_kernels, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """``case`` in bfloat16 with decode attention's scores on AMX tiles, then on AVX512-BF16."""
    if cpu_ops == "torch":
        pytest.skip("the PyTorch path has neither")
    if not native_kernels.attention_use_amx():
        pytest.skip("this CPU has no AMX tiles (or Linux does not grant them): only the AVX512-BF16 loop runs")
    try:
        on = run_bf16(case)
        native_kernels.attention_use_amx(False)
        off = run_bf16(case)
    finally:
        native_kernels.attention_use_amx(True)
    return on, off


AMX_CASES = {
    "decodes": ([], [1, 15, 16, 17, 250, 129]),
    "one decode": ([], [200]),
    "prefills and decodes": PREFILLS_AND_DECODES,
}


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", AMX_HEAD_SHAPES)
@pytest.mark.parametrize("name", AMX_CASES)
def test_scores_on_amx_tiles_match_the_avx512_ones(cpu_ops, native_kernels, num_heads, num_kv_heads, head_dim, name):
    """16-token blocks with stale NaN in the last blocks' unused slots, which a tile loads but must never use."""
    case = make_case(*AMX_CASES[name], num_heads, num_kv_heads, head_dim=head_dim, block_size=16, seed=11)
    flat = case.cache.view(2, -1, *case.cache.shape[-2:])
    for i, ctx in enumerate(case.meta.context_lens):
        table = case.meta.block_tables[i]
        flat[:, [table[t // 16] * 16 + t % 16 for t in range(ctx, -(-ctx // 16) * 16)]] = float("nan")
    on, off = scores_on_and_off(cpu_ops, native_kernels, case)
    assert not on.isnan().any()
    torch.testing.assert_close(on.float(), case.expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(on.float(), off.float(), atol=1e-2, rtol=1e-2)  # one bfloat16 rounding apart at most


def test_scores_do_run_on_amx_tiles(cpu_ops, native_kernels):
    # The two sum the same products in different orders, which shows in a few outputs' last bit (for decoding,
    # 3 of the 128-dim heads' 24576 here): were the switch to change nothing, every output would be the same.
    differing = {"prefill": 0, "decode": 0}
    for num_heads, num_kv_heads, head_dim in AMX_HEAD_SHAPES:
        case = make_case(*PREFILLS_AND_DECODES, num_heads, num_kv_heads, head_dim, block_size=16, seed=11)
        on, off = scores_on_and_off(cpu_ops, native_kernels, case)
        split = case.meta.num_prefill_tokens
        differing["prefill"] += int((on[:split] != off[:split]).sum())
        decodes = make_case([], [1, 15, 16, 17, 250, 129], num_heads, num_kv_heads, head_dim, block_size=16, seed=11)
        on, off = scores_on_and_off(cpu_ops, native_kernels, decodes)
        differing["decode"] += int((on != off).sum())
    assert differing["prefill"] > 0 and differing["decode"] > 0, differing
