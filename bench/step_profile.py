"""Where the time of ``bench/compare.sh``'s load goes inside servelm's engine, step by step, against the
machine's bfloat16 GEMM peak, in one process.

On the CPU. First the peak (bench/machine_limits.py's products, by default its 2048 x 896 x 4864;
``--gemm``). Then servelm's engine (``LLM``) runs the load compare.sh sends: --num-prompts prompts of --input-len random tokens (the chat
template makes compare.sh's 128 about 158), --output-len tokens each, up to --max-num-seqs at once,
temperature 1.0, no prefix cache, --repeats times after a warm-up. Every engine step is timed with its
parts: the model's forward, the LM head, the sampler, and the rest of the runner's step. The steps are
grouped as prefill-only, mixed (a prefill chunk beside decodes) and decode-only, each group with its FLOPs
(bench/model_cost.py's conventions: the matmuls, the LM head, attention's two products) and rate.

Then decode attention alone: servelm's native kernel for a full batch over every layer's own cache (of --kv-cache-dtype; so
that K and V come from memory, as in a step) at the decode steps' mean context, each sequence's blocks side
by side. Last, a ceiling: the level's time if every FLOP but decode attention's ran at the peak, plus, for
every decode step, the attention, sampling and rest as measured; the fraction of the peak the level would
reach with the matmuls at the peak and nothing else faster. The forward's other work (norms, RoPE, K/V
writes, the threads' waits) counts as free there, so the ceiling is a generous one.

    .venv/bin/python bench/step_profile.py --model ~/.cache/servelm-bench/models/qwen2.5-0.5b-random-bf16
    .venv/bin/python bench/step_profile.py --quantization w8a8 --peak int8 [--kv-cache-dtype int8]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from dataclasses import dataclass, field

import torch
from machine_limits import DEFAULT_GEMMS, add_gemm_option, measure
from machine_limits import summary as limits_summary
from model_cost import ModelCost

from servelm import LLM, SamplingParams, kernels
from servelm.layers.kv_int8 import quantize_rows


@dataclass
class Step:
    prefill_tokens: int
    decodes: int
    flops: float  # all of the step's FLOPs
    decode_attention_flops: float  # the decodes' share of attention
    seconds: float
    parts: dict[str, float] = field(default_factory=dict)  # forward, logits, sample


def step_flops(cost: ModelCost, out) -> tuple[float, float]:
    """(all FLOPs, the decodes' attention FLOPs) of a scheduled step."""
    prefill = [(s.start, s.num_new_tokens) for s in out.prefills]
    decodes = [d.start for d in out.decodes]
    tokens = sum(n for _, n in prefill) + len(decodes)
    sampled = sum(1 for s in out.prefills if s.is_sampling) + len(decodes)
    # A token at position p (0-based) attends over p + 1 keys.
    prefill_keys = sum(start * n + n * (n + 1) // 2 for start, n in prefill)
    decode_attention = cost.attention_flops(sum(p + 1 for p in decodes))
    flops = 2 * cost.body_params * tokens + 2 * cost.head_params * sampled + cost.attention_flops(prefill_keys)
    return flops + decode_attention, decode_attention


class StepClock:
    """Times each of the runner's steps and its parts, by wrapping the runner's calls."""

    def __init__(self, llm: LLM, cost: ModelCost):
        self.steps: list[Step] = []
        self._parts: dict[str, float] = {}
        runner = llm.engine.runner
        model = runner.model
        self._wrap(model, "forward", "forward")
        self._wrap(model, "compute_logits", "logits")
        self._wrap(runner, "_sample", "sample")
        execute = runner.execute

        def timed_execute(out, *args, **kwargs):
            self._parts = {}
            start = time.perf_counter()
            result = execute(out, *args, **kwargs)
            seconds = time.perf_counter() - start
            flops, decode_attention = step_flops(cost, out)
            prefill = sum(s.num_new_tokens for s in out.prefills)
            self.steps.append(Step(prefill, len(out.decodes), flops, decode_attention, seconds, self._parts))
            return result

        runner.execute = timed_execute

    def _wrap(self, owner, name: str, part: str) -> None:
        call = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = call(*args, **kwargs)
            self._parts[part] = self._parts.get(part, 0.0) + time.perf_counter() - start
            return result

        setattr(owner, name, timed)


def decode_attention_seconds(
    cost: ModelCost, batch: int, context: int, kv_int8: bool = False, repeats: int = 5
) -> float | None:
    """One full-batch decode step's attention over all layers (bfloat16 caches, or int8 ones as
    ``--kv-cache-dtype int8`` keeps them), the native kernel, median of ``repeats``."""
    native = kernels.cpu_kernels()
    if native is None:
        return None
    blocks = -(-context // 16)
    gen = torch.Generator().manual_seed(0)
    shape = (2, batch * blocks, 16, cost.kv_heads, cost.head_dim)
    caches = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(cost.layers)]
    caches = [quantize_rows(cache) for cache in caches] if kv_int8 else caches
    query = torch.randn(batch, cost.heads, cost.head_dim, generator=gen).to(torch.bfloat16)
    tables = torch.arange(batch * blocks).view(batch, blocks)
    lens = torch.full((batch,), context, dtype=torch.long)
    scale = cost.head_dim**-0.5

    def run() -> float:
        start = time.perf_counter()
        for cache in caches:
            native.decode_attention(query, cache, tables, lens, scale)
        return time.perf_counter() - start

    run()
    return statistics.median(run() for _ in range(repeats))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gemm_option(ap, DEFAULT_GEMMS[:1])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a bundled name or a Hugging Face folder")
    ap.add_argument("--quantization", default="none", choices=["none", "w8a8"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"], help="as the server's")
    ap.add_argument("--peak", default="bf16", choices=["bf16", "int8"], help="the peak the rates are held against")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=158)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of the whole load; the last is shown")
    args = ap.parse_args(argv)

    limits = limits_summary(measure(args.gemm, 64, 5))
    peak = limits["bf16_gemm_flops" if args.peak == "bf16" else "int8_gemm_ops"]
    print(f"{args.peak} GEMM peak {peak / 1e9:.1f} G/s ({limits[args.peak + '_gemm_how']})")

    llm = LLM(
        args.model,
        dtype="bfloat16",
        device="cpu",  # the peak, the kernels and the ceiling are the CPU's
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory=2 << 30,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=False,
    )
    cost = ModelCost.from_hf_config(dataclasses.asdict(llm.engine.runner.model_config))  # its HF names
    clock = StepClock(llm, cost)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(200, cost.vocab, (args.num_prompts, args.input_len), generator=gen).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4))
    for _ in range(args.repeats):
        clock.steps.clear()
        start = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - start
    steps = clock.steps
    flops = sum(s.flops for s in steps)
    print(
        f"{args.model} ({args.quantization}, {args.kv_cache_dtype} cache): {len(steps)} steps, {wall:.2f} s, "
        f"{args.num_prompts * args.output_len / wall:.1f} output tok/s, "
        f"{flops / wall / 1e9:.0f} G/s = {flops / wall / peak:.1%} of the peak"
    )
    groups = {
        "prefill-only": [s for s in steps if s.prefill_tokens and not s.decodes],
        "mixed": [s for s in steps if s.prefill_tokens and s.decodes],
        "decode-only": [s for s in steps if not s.prefill_tokens],
    }
    for name, group in groups.items():
        if group:
            seconds, work = sum(s.seconds for s in group), sum(s.flops for s in group)
            print(
                f"  {name:<13} {len(group):4d} steps {seconds:6.2f} s ({seconds / wall:4.0%} of the wall time) "
                f"{work / seconds / 1e9:6.0f} G/s = {work / seconds / peak:.1%} of the peak"
            )
    full = [s for s in groups["decode-only"] if s.decodes == args.max_num_seqs]
    if not full:
        return 0
    parts = {p: statistics.median(s.parts.get(p, 0.0) for s in full) for p in ("forward", "logits", "sample")}
    step = statistics.median(s.seconds for s in full)
    rest = step - sum(parts.values())
    print(
        f"  a decode step of {args.max_num_seqs} rows, medians of {len(full)}: {step * 1e3:.2f} ms = forward "
        f"{parts['forward'] * 1e3:.2f} + LM head {parts['logits'] * 1e3:.2f} + sampling {parts['sample'] * 1e3:.2f} "
        f"+ the rest {rest * 1e3:.2f}"
    )
    context = round(statistics.mean(s.decode_attention_flops for s in full) / cost.attention_flops(args.max_num_seqs))
    attention = decode_attention_seconds(cost, args.max_num_seqs, context, args.kv_cache_dtype == "int8")
    if attention is None:
        print("  (no native kernels here: no decode attention timing, no ceiling)")
        return 0
    print(f"  decode attention alone, {args.max_num_seqs} x {context} keys, all layers: {attention * 1e3:.2f} ms")
    decodes = groups["decode-only"]
    # the decode steps' time outside their matmuls: attention (a batch's share of the full one), sampling, the rest
    outside = sum(
        s.seconds - s.parts.get("forward", 0.0) - s.parts.get("logits", 0.0) + attention * s.decodes / args.max_num_seqs
        for s in decodes
    )
    at_peak = (flops - sum(s.decode_attention_flops for s in decodes)) / peak
    print(
        f"  ceiling: {at_peak:.2f} s of FLOPs at the peak + {outside:.2f} s of decode attention, sampling and the "
        f"rest = {at_peak + outside:.2f} s: {flops / (at_peak + outside) / peak:.1%} of the peak "
        f"(measured {flops / wall / peak:.1%})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
