"""servelm's W8A8 GEMM against the bfloat16 oneDNN linear it replaces, on the same shapes, in one run.

For each M x K x N (activations M x K, weight N x K), timed calls alternate
between the candidates (so that a change in the machine's load hits all of
them), and each candidate's best time counts:

- ``bf16 oneDNN``: ``PackedLinear`` (oneDNN, weight prepacked), what
  unquantized bfloat16 prefill runs;
- with M up to 64 also ``bf16 pairs``: servelm's small bfloat16 GEMM, what
  unquantized bfloat16 decoding runs on AVX512-BF16 CPUs (``cpu_matmul``),
  on AMX tiles from 2 rows where the CPU has them, as decoding does there;
- ``w8a8``: ``W8A8Linear``'s kernel over bfloat16 activations (quantizing the
  rows on the fly is inside the timing), on AMX-INT8 tiles where the CPU has
  them (from 8 rows), else AVX512-VNNI;
- where AMX runs, also ``w8a8 vnni``: the same kernel with AMX turned off;
- with M = 1 also ``int8 gemv``: the weight-only int8 matrix-vector kernel
  that ``W8A8Linear`` runs for one row instead (the reason it does).

Integer multiply-adds count 2 ops, as FLOPs do; the ratio is w8a8's rate over
the faster bfloat16 candidate's. With ``--copies N`` every candidate keeps N
copies of its weight and a timed call passes over all of them, one product
each, so that the weights come from memory as a decoding step's do (each
layer's weight is read once a step) rather than from the caches; the
rate is then per product. Default shapes: bench/machine_limits.py's Qwen2.5-0.5B MLP on 2048
tokens, and the bundled SmolLM2-135M's layers (qkv, o, gate_up, down) on 2048
prefill tokens, 32 decoding rows and 1 row.

    .venv/bin/python bench/w8a8_gemm.py
    .venv/bin/python bench/w8a8_gemm.py --gemm 512x576x1536 --repeats 20 --threads 1
    .venv/bin/python bench/w8a8_gemm.py --gemm 32x576x576 32x1536x576 --copies 60 --repeats 15
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from machine_limits import add_gemm_option

SMOLLM_LAYERS = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K, N): qkv, o, gate_up, down
COLUMNS = ("bf16 oneDNN", "bf16 pairs", "int8 gemv", "w8a8 vnni", "w8a8")
DEFAULT_GEMMS = ["2048x896x4864"] + [f"{m}x{k}x{n}" for m in (2048, 32, 1) for k, n in SMOLLM_LAYERS]


def candidates(m: int, k: int, n: int, copies: int) -> dict[str, object]:
    from servelm import kernels
    from servelm.models.packed import PAIR_MAX_ROWS, PackedLinear
    from servelm.models.w8a8 import W8A8Linear

    native = kernels.cpu_kernels()
    if native is None:
        raise SystemExit("servelm's CPU kernels are unavailable here")
    x = torch.randn(m, k).to(torch.bfloat16)
    weights = [torch.randn(n, k).to(torch.bfloat16) for _ in range(copies)]
    layers, packed = [W8A8Linear(w) for w in weights], [PackedLinear(w) for w in weights]
    if layers[0].packed is None:
        raise SystemExit("the W8A8 kernel does not run on this CPU (no AVX512-VNNI)")

    def w8a8(amx: bool):
        def run():
            native.w8a8_use_amx(amx)
            for layer in layers:
                native.w8a8_linear(x, layer.packed, layer.weight_scales, n)

        return run

    runs = {"bf16 oneDNN": lambda: [p(x) for p in packed], "w8a8": w8a8(True)}
    if native.w8a8_use_amx():
        runs["w8a8 vnni"] = w8a8(False)
    pairs = [native.pack_pairs(w) for w in weights] if m <= PAIR_MAX_ROWS else [None]
    if pairs[0] is not None:
        amx = m > 1 and native.pairs_amx(k)
        runs["bf16 pairs"] = lambda: [native.gemm_pairs(x, p, n, amx=amx) for p in pairs]
    if m == 1:
        runs["int8 gemv"] = lambda: [native.int8_linear(x, layer.qweight, layer.scales) for layer in layers]
    return runs


def restore_amx() -> None:
    """AMX on again (the default where it runs), whichever candidate ran last."""
    from servelm import kernels

    native = kernels.cpu_kernels()
    if native is not None:
        native.w8a8_use_amx(True)


def best_times(runs: dict[str, object], repeats: int) -> dict[str, float]:
    best = dict.fromkeys(runs, float("inf"))
    for run in runs.values():
        run()  # warm-up: oneDNN builds its kernel on the first call
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gemm_option(ap, DEFAULT_GEMMS)
    ap.add_argument("--repeats", type=int, default=10, help="alternating rounds; each candidate's best counts")
    ap.add_argument("--threads", type=int, help="torch's (and the kernels') threads (default: the cores)")
    ap.add_argument(
        "--copies", type=int, default=1, help="weights per candidate, a timed call passing over all (from memory)"
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"cpu threads={torch.get_num_threads()}, best of {args.repeats} alternating calls"
        f"{f' over {args.copies} copies of each weight' if args.copies > 1 else ''}; G = 1e9 (int8 ops or FLOPs)/s"
    )
    print(f"{'M x K x N':>16s}" + "".join(f"{name:>13s}" for name in (*COLUMNS, "w8a8/bf16")))
    with torch.inference_mode():
        for m, k, n in args.gemm:
            try:
                best = best_times(candidates(m, k, n, args.copies), args.repeats)
            finally:
                restore_amx()
            rate = {name: 2 * m * k * n * args.copies / t / 1e9 for name, t in best.items()}
            cells = "".join(f"{rate[name]:13.1f}" if name in rate else f"{'-':>13s}" for name in COLUMNS)
            bf16 = max(rate.get("bf16 oneDNN", 0.0), rate.get("bf16 pairs", 0.0))
            print(f"{f'{m}x{k}x{n}':>16s}{cells}{rate['w8a8'] / bf16:12.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
