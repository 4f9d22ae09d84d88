"""servelm's native CPU kernels (servelm/kernels) against the PyTorch path they replace, in one run.

Part 1 times one layer's decode attention at the model's head shapes for a few
batch sizes and context lengths: the native paged kernel against gather + SDPA,
with each path's largest difference from a float64 reference (with --layers N,
per layer over N layers' caches in turn, read from memory as a decoding step
reads them rather than from the CPU's caches); then one layer's
prefill attention in bfloat16 (fresh prompts and prompts behind a cached
prefix), the native kernel against SDPA per prompt. Part 2 runs the
engine on the same requests with all native kernels on and all off (attention,
the fused norm, RoPE and SiLU ops, the GEMV, the small GEMM and the one-call
decoding step; alternating, median of --repeats) and
prints output tokens/s and the ratio, for the whole batch and for batch 1.

    .venv/bin/python bench/kernels.py
    .venv/bin/python bench/kernels.py --num-prompts 32 --input-len 128 --output-len 128 --repeats 3
    .venv/bin/python bench/kernels.py --layers 30 --skip-engine   # decode attention from memory
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from servelm import kernels
from servelm.layers.attention import AttentionMetadata, paged_attention
from servelm.platform.memory import keep_freed_memory

PYTORCH_PATH = mock.patch.object(kernels, "cpu_kernels", lambda: None)


def _median_us(fn, calls: int = 30, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def layer_case(batch, context, heads, kv_heads, head_dim, dtype, block_size=16, seed=0):
    """A decode-only step over a shuffled paged cache; returns (run, float64 reference)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-context // block_size)
    cache = torch.randn(2, batch * blocks + 8, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(cache.shape[1], generator=gen)[: batch * blocks].view(batch, blocks)
    lens = [max(1, context - 5 * (i % 4)) for i in range(batch)]
    query = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    new_kv = torch.randn(batch, kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.tensor(
        [tables[i, (n - 1) // block_size] * block_size + (n - 1) % block_size for i, n in enumerate(lens)]
    )
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_lens=[1] * batch,
        context_lens=lens,
        block_tables=tables,
        num_prefills=0,
        num_prefill_tokens=0,
        decode_lens=torch.tensor(lens),
    )
    scale = head_dim**-0.5

    def run():
        return paged_attention(query, new_kv, new_kv, cache, meta, scale)

    run()  # writes the new K/V, so the reference below sees them
    return run, kernels.reference_decode_attention(query, cache, tables, meta.decode_lens, scale)


def part_layer(dtype: torch.dtype, layers: int) -> None:
    where = f"{layers} layers' caches in turn, from memory" if layers > 1 else "one cache, from the caches"
    print(
        f"one layer's decode attention, 9 heads / 3 KV heads x 64 (SmolLM2-135M), {dtype}, "
        f"threads={torch.get_num_threads()}, {where}"
    )
    print(
        f"{'batch':>6s}{'context':>9s}{'pytorch us':>12s}{'native us':>11s}{'ratio':>8s}{'err pytorch':>13s}{'err native':>12s}"
    )
    for batch, context in [(1, 200), (1, 1000), (8, 200), (32, 100), (32, 200), (32, 500)]:
        cases = [layer_case(batch, context, 9, 3, 64, dtype, seed=seed) for seed in range(layers)]
        run, ref = cases[0]
        runs = [r for r, _ in cases]

        def step(runs=runs):  # each layer's cache once, as a decoding step reads them
            for r in runs:
                r()

        native_err = (run().double() - ref).abs().max().item()
        native = _median_us(step, calls=max(1, 30 // layers)) / layers
        with PYTORCH_PATH:
            torch_err = (run().double() - ref).abs().max().item()
            pytorch = _median_us(step, calls=max(1, 30 // layers)) / layers
        print(
            f"{batch:6d}{context:9d}{pytorch:12.1f}{native:11.1f}{pytorch / native:7.2f}x{torch_err:13.2e}{native_err:12.2e}"
        )


def prefill_case(prompts, context, new, heads, kv_heads, head_dim, block_size=16, seed=0):
    """A step of ``prompts`` bfloat16 prefills of ``new`` tokens each at the end of ``context``-token contexts
    (the rest cached) over a shuffled paged cache; returns (run, float64 reference)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-context // block_size)
    cache = torch.randn(2, prompts * blocks + 8, block_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    tables = torch.randperm(cache.shape[1], generator=gen)[: prompts * blocks].view(prompts, blocks)
    query = torch.randn(prompts * new, heads, head_dim, generator=gen).to(torch.bfloat16)
    new_kv = torch.randn(prompts * new, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    positions = range(context - new, context)
    slots = torch.tensor(
        [tables[i, t // block_size] * block_size + t % block_size for i in range(prompts) for t in positions]
    )
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_lens=[new] * prompts,
        context_lens=[context] * prompts,
        block_tables=tables,
        num_prefills=prompts,
        num_prefill_tokens=prompts * new,
    )
    scale = head_dim**-0.5

    def run():
        meta.prefix_masks.clear()  # built once per step in the engine, so once per call here
        return paged_attention(query, new_kv, new_kv, cache, meta, scale)

    run()
    # token t of a prefill attends as a decoding token at its position
    token_tables = tables.repeat_interleave(new, 0)
    lens = torch.tensor([t + 1 for _ in range(prompts) for t in positions])
    return run, kernels.reference_decode_attention(query, cache, token_tables, lens, scale)


def part_prefill() -> None:
    print(
        f"\none layer's prefill attention, 9 heads / 3 KV heads x 64 (SmolLM2-135M), bfloat16, "
        f"threads={torch.get_num_threads()}"
    )
    print(
        f"{'prompts':>8s}{'context':>9s}{'new':>6s}{'pytorch us':>12s}{'native us':>11s}{'ratio':>8s}"
        f"{'err pytorch':>13s}{'err native':>12s}"
    )
    for prompts, context, new in [(1, 158, 158), (1, 158, 142), (12, 158, 142), (1, 1024, 1024), (1, 2048, 512)]:
        run, ref = prefill_case(prompts, context, new, 9, 3, 64)
        native_err = (run().double() - ref).abs().max().item()
        native = _median_us(run, calls=10)
        with PYTORCH_PATH:
            torch_err = (run().double() - ref).abs().max().item()
            pytorch = _median_us(run, calls=10)
        print(
            f"{prompts:8d}{context:9d}{new:6d}{pytorch:12.1f}{native:11.1f}{pytorch / native:7.2f}x"
            f"{torch_err:13.2e}{native_err:12.2e}"
        )


def part_engine(args) -> None:
    from servelm import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device="cpu", max_num_seqs=args.num_prompts, kv_cache_memory=2 << 30)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.engine.runner.model_config.vocab_size
    prompts = [torch.randint(100, vocab, (args.input_len,), generator=gen).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up

    def rate(batch) -> float:
        start = time.perf_counter()
        llm.generate(batch, params)
        return len(batch) * args.output_len / (time.perf_counter() - start)

    rows = {}
    for label, batch in [(f"batch {args.num_prompts}", prompts), ("batch 1", prompts[:1])]:
        native, pytorch = [], []
        for _ in range(args.repeats):
            native.append(rate(batch))
            with PYTORCH_PATH:
                pytorch.append(rate(batch))
        rows[label] = statistics.median(pytorch), statistics.median(native)
    print(
        f"\nengine, {llm.engine.runner.dtype}, {args.input_len} prompt + {args.output_len} output tokens, "
        f"median of {args.repeats} (alternating)"
    )
    print(f"{'':10s}{'pytorch tok/s':>15s}{'native tok/s':>14s}{'ratio':>8s}")
    for label, (pytorch, native) in rows.items():
        print(f"{label:10s}{pytorch:15.1f}{native:14.1f}{native / pytorch:7.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto", help="the engine's dtype (auto: servelm's choice for this CPU)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-engine", action="store_true", help="part 1 only")
    ap.add_argument(
        "--layers",
        type=int,
        default=1,
        help="decode attention over this many layers' caches in turn (30: SmolLM2's, from memory as a model "
        "step reads them; 1: one cache, which stays in the CPU's caches)",
    )
    args = ap.parse_args()
    keep_freed_memory()  # as the engine does
    if kernels.cpu_kernels() is None:
        raise SystemExit("the native kernels are not available here (see the warning above)")
    for dtype in (torch.bfloat16, torch.float32):
        part_layer(dtype, args.layers)
    part_prefill()
    if not args.skip_engine:
        part_engine(args)


if __name__ == "__main__":
    main()
