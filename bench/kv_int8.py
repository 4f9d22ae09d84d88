"""One layer's attention over an int8 KV cache (``--kv-cache-dtype int8``) against a bfloat16 one, native
kernels on both sides, in one process.

For each model's head shape, decode steps of 32 sequences (and one long one) and a prefill step of 12
prompts behind a cached prefix: the step's time over each cache (the two alternating, ``--repeats``
rounds of ``--calls`` calls, median per round), the ratio bfloat16 / int8, and each side's largest
difference from float64 attention over the bfloat16 cache's values (the int8 side's includes its rounding).
With ``--layers N`` a call passes over N layers' caches in turn (time per layer), so that they come from
memory rather than from the CPU's caches.

    .venv/bin/python bench/kv_int8.py
    .venv/bin/python bench/kv_int8.py --repeats 9 --calls 50
    .venv/bin/python bench/kv_int8.py --layers 30 --repeats 5   # the caches from memory
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from servelm import kernels
from servelm.layers.attention import AttentionMetadata, paged_attention
from servelm.layers.kv_int8 import quantize_rows

SHAPES = {"SmolLM2-135M": (9, 3, 64), "Qwen2.5-0.5B": (14, 2, 64), "Llama-3.2-1B": (32, 8, 64)}
BF16 = torch.bfloat16


def step(prompts: int, context: int, new: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    """A step of ``prompts`` sequences with ``new`` tokens each (1: decoding) at the end of ``context``-token
    contexts over a shuffled paged cache: (run(cache), bfloat16 cache, int8 cache, float64 reference)."""
    gen = torch.Generator().manual_seed(seed)
    block_size, blocks = 16, -(-context // 16)
    cache = torch.randn(2, prompts * blocks + 8, block_size, kv_heads, head_dim, generator=gen).to(BF16)
    tables = torch.randperm(cache.shape[1], generator=gen)[: prompts * blocks].view(prompts, blocks)
    query = torch.randn(prompts * new, heads, head_dim, generator=gen).to(BF16)
    fresh = torch.randn(prompts * new, kv_heads, head_dim, generator=gen).to(BF16)
    positions = range(context - new, context)
    slots = torch.tensor([tables[i, t // 16] * 16 + t % 16 for i in range(prompts) for t in positions])
    prefills = prompts if new > 1 else 0
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_lens=[new] * prompts,
        context_lens=[context] * prompts,
        block_tables=tables,
        num_prefills=prefills,
        num_prefill_tokens=prefills * new,
        decode_lens=None if prefills else torch.tensor([context] * prompts),
    )
    scale = head_dim**-0.5

    def run(kv_cache: torch.Tensor) -> torch.Tensor:
        meta.prefix_masks.clear()
        return paged_attention(query, fresh, fresh, kv_cache, meta, scale)

    run(cache)  # the step's own K/V into the bfloat16 cache, then both caches hold the same values
    int8 = quantize_rows(cache)
    token_tables = tables.repeat_interleave(new, 0)
    lens = torch.tensor([t + 1 for _ in range(prompts) for t in positions])
    return run, cache, int8, kernels.reference_decode_attention(query, cache, token_tables, lens, scale)


def timed(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7, help="rounds, each timing both caches in turn")
    ap.add_argument("--calls", type=int, default=30, help="calls per side and round")
    ap.add_argument(
        "--layers",
        type=int,
        default=1,
        help="each step over this many layers' caches in turn (30: from memory, as a model step reads them; "
        "1: one cache, which a large L3 holds)",
    )
    args = ap.parse_args()
    if kernels.cpu_kernels() is None:
        raise SystemExit("servelm's CPU kernels are unavailable here: nothing to compare")
    print(f"one layer's attention, bfloat16 queries, threads={torch.get_num_threads()}")
    print(f"{'shape':>14s}{'step':>26s}{'bf16 us':>10s}{'int8 us':>10s}{'ratio':>8s}{'err bf16':>10s}{'err int8':>10s}")
    cases = [(32, 160, 1), (32, 500, 1), (32, 1000, 1), (1, 2000, 1), (12, 158, 142)]
    for name, (heads, kv_heads, head_dim) in SHAPES.items():
        for prompts, context, new in cases:
            layers = [step(prompts, context, new, heads, kv_heads, head_dim, seed=seed) for seed in range(args.layers)]
            run, bf16, int8, ref = layers[0]
            errors = [(run(c).double() - ref).abs().max().item() for c in (bf16, int8)]

            def each_layer(side: int, layers=layers) -> None:  # every layer's cache once, as a model step reads them
                for layer in layers:
                    layer[0](layer[1 + side])

            rounds = []
            for _ in range(args.repeats):
                rounds.append(
                    tuple(
                        timed(functools.partial(each_layer, side), max(1, args.calls // args.layers)) / args.layers
                        for side in (0, 1)
                    )
                )
            b, i = statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)
            ratio = statistics.median(r[0] / r[1] for r in rounds)
            what = f"{prompts} x {'decode' if new == 1 else f'{new} new'} @ {context}"
            print(f"{name:>14s}{what:>26s}{b:10.1f}{i:10.1f}{ratio:7.2f}x{errors[0]:10.2e}{errors[1]:10.2e}")


if __name__ == "__main__":
    main()
