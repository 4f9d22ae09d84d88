"""The per-call cost of servelm's kernel boundary, in one run.

Each of servelm's kernels is a PyTorch op registered in C++ (``TORCH_LIBRARY``
in servelm/kernels/ops.cpp), which checks its arguments and calls C. This
times ``servelm::silu_mul`` on a tiny tensor, where a call is nearly all
overhead, against the same op behind the two Python ways of registering an op
(``torch.library.Library`` + a Python implementation, and
``torch.library.custom_op``), each adding its layer on top, and one aten op
(``F.silu``) as the floor. It prints microseconds per call (median of
--repeats) and what the difference to the C++ op costs a layer-by-layer
decoding step of ``--calls-per-step`` calls.

    .venv/bin/python bench/op_overhead.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from servelm import kernels


def _us_per_call(fn, x: torch.Tensor, calls: int) -> float:
    for _ in range(calls // 10):
        fn(x)
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000, help="calls per timing")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls-per-step", type=int, default=150, help="native calls of a step: ~5 a layer x 30 layers")
    args = ap.parse_args()
    native = kernels.cpu_kernels()
    if native is None:
        raise SystemExit("the native kernels are not available here (see the warning above)")
    op = torch.ops.servelm.silu_mul.default

    library = torch.library.Library("servelm_bench", "DEF")  # held: the registration lives as long as it does
    library.define("silu_mul(Tensor gate_up) -> Tensor")
    library.impl("silu_mul", lambda gate_up: op(gate_up), "CPU")

    @torch.library.custom_op("servelm_bench::silu_mul_custom", mutates_args=())
    def custom(gate_up: torch.Tensor) -> torch.Tensor:
        return op(gate_up)

    cases = {
        "aten F.silu (floor)": F.silu,
        "servelm op (C++ TORCH_LIBRARY)": op,
        "CpuKernels.silu_mul (its Python face)": native.silu_mul,
        "+ Library DEF + Python impl": torch.ops.servelm_bench.silu_mul.default,
        "+ torch.library.custom_op": custom,
    }
    x = torch.randn(4, 128).to(torch.bfloat16)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    with torch.inference_mode():
        for _ in range(args.repeats):  # interleaved, so that load on the machine hits every case alike
            for name, fn in cases.items():
                samples[name].append(_us_per_call(fn, x, args.calls))
    base = statistics.median(samples["servelm op (C++ TORCH_LIBRARY)"])
    print(
        f"silu_mul of a [4, 128] bfloat16 tensor, median of {args.repeats} x {args.calls} calls, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'':40s}{'us/call':>9s}{'vs op':>8s}{'ms/step':>9s}")
    for name, times in samples.items():
        us = statistics.median(times)
        extra = (us - base) * args.calls_per_step / 1e3
        print(f"{name:40s}{us:9.2f}{us / base:7.2f}x{extra:+9.2f}")


if __name__ == "__main__":
    main()
