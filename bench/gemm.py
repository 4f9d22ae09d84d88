"""The decoder's matmuls on CPU: float32 and bfloat16 ``F.linear`` against bfloat16 prepacked weights.

Times every linear layer of one forward pass of a model shaped like
SmolLM2-135M (30 layers: q/k/v, o, gate/up, down) plus its LM head, for a
range of row counts M (M=1 is batch-1 decoding, large M is prefill). Prints
milliseconds per pass, the median of --repeats, and the speed-up of packed
bfloat16 over plain bfloat16 and over float32 in the same run. This is the
measurement behind ``servelm/models/packed.py`` and ``--dtype auto``. For
M=1 it then times servelm's own GEMV kernel over the plain bfloat16 weights
(``PackedLinear(keep_plain=True)``, what batch-1 decoding runs) against the
packed weights, alternating, with the bytes of weights read per second: once
over plain weights as PyTorch allocates them, once over copies on transparent
huge pages (``huge_page_copies``, where the model runner puts them). For up
to 64 rows, where the CPU has AVX512-BF16, it also times servelm's small-GEMM
kernel over the pair layout (``PackedLinear(pair_rows=PAIR_MAX_ROWS)``, what decoding
runs on such a CPU) against the packed weights. Last, for up to 64 rows in
float32 and in bfloat16, servelm's matrix-vector kernel over the plain weight
read once for all the rows (``packed.plain_rows``, what decoding runs on an
AVX2 CPU) against oneDNN's packed weights, alternating, with the speed-up.

    .venv/bin/python bench/gemm.py --rows 1 8 32 128 512
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from servelm import kernels
from servelm.models.packed import PAIR_MAX_ROWS, PackedLinear, can_pack
from servelm.platform.cpu import onednn_has_bf16
from servelm.platform.memory import huge_page_copies

HIDDEN, FFN, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152


def _shapes(with_head: bool) -> list[tuple[int, int]]:
    layer = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * FFN, HIDDEN), (HIDDEN, FFN)]
    return layer * LAYERS + ([(VOCAB, HIDDEN)] if with_head else [])


def _median_ms(fn, repeats: int) -> float:
    fn()  # oneDNN builds its kernels on the first call of a shape
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-head", action="store_true", help="leave out the 49152-row LM head")
    args = ap.parse_args()

    packable = can_pack(torch.bfloat16, torch.device("cpu"))
    widened = "" if onednn_has_bf16() else " (packed as float32: no bfloat16 instructions)"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16 packing available: {packable}{widened}")
    shapes = _shapes(not args.no_head)
    weights = {dt: [torch.randn(o, i).to(dt) for o, i in shapes] for dt in (torch.float32, torch.bfloat16)}
    packed = [PackedLinear(w) for w in weights[torch.bfloat16]] if packable else []
    pairs = [PackedLinear(w, pair_rows=PAIR_MAX_ROWS) for w in weights[torch.bfloat16]] if packable else []
    if not all(p.pair_weight is not None for p in pairs):
        pairs = []  # no small-GEMM kernel here (it needs AVX512-BF16), or a shape it cannot take
    header = f"{'M':>6} {'fp32 ms':>9} {'bf16 ms':>9} {'packed ms':>10} {'packed/bf16':>12} {'packed/fp32':>12}"
    print(header + (f" {'pairs ms':>9} {'pairs/packed':>13}" if pairs else ""))
    with torch.inference_mode():
        for m in args.rows:
            inputs = {dt: {i: torch.randn(m, i).to(dt) for i in (HIDDEN, FFN)} for dt in weights}
            plain = {
                dt: _median_ms(
                    lambda dt=dt, ws=ws, inputs=inputs: [F.linear(inputs[dt][w.shape[1]], w) for w in ws], args.repeats
                )
                for dt, ws in weights.items()
            }
            fp32, bf16 = plain[torch.float32], plain[torch.bfloat16]
            if packed:
                x = inputs[torch.bfloat16]
                pk = _median_ms(lambda x=x: [p(x[p.in_features]) for p in packed], args.repeats)
                line = f"{m:>6} {fp32:>9.1f} {bf16:>9.1f} {pk:>10.1f} {bf16 / pk:>11.2f}x {fp32 / pk:>11.2f}x"
                if pairs and m <= PAIR_MAX_ROWS:
                    pr = _median_ms(lambda x=x: [p(x[p.in_features]) for p in pairs], args.repeats)
                    line += f" {pr:>9.1f} {pk / pr:>12.2f}x"
                print(line)
            else:
                print(f"{m:>6} {fp32:>9.1f} {bf16:>9.1f} {'-':>10} {'-':>12} {'-':>12}")
        if packed and kernels.cpu_kernels() is not None:
            _gemv_against_packed(weights[torch.bfloat16], packed, args.repeats)
            _plain_rows_against_packed(weights, [m for m in args.rows if m <= PAIR_MAX_ROWS], args.repeats)


def _gemv_against_packed(weights: list[torch.Tensor], packed: list[PackedLinear], repeats: int) -> None:
    gemv = [PackedLinear(w, keep_plain=True) for w in weights]
    huge = [PackedLinear(w, keep_plain=True) for w in weights]
    for layer, copy in zip(huge, huge_page_copies(weights)):
        layer.plain_weight = copy  # as the model runner places them
    x = {i: torch.randn(1, i).to(torch.bfloat16) for i in (HIDDEN, FFN)}
    runs = {"packed": packed, "gemv": gemv, "gemv, huge pages": huge}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(3):  # alternate, so that a noisy moment hits all
        for name, layers in runs.items():
            times[name].append(_median_ms(lambda layers=layers: [p(x[p.in_features]) for p in layers], repeats))
    gigabytes = sum(w.nbytes for w in weights) / 1e9
    ms = {name: statistics.median(t) for name, t in times.items()}
    print(
        "M=1: "
        + ", ".join(
            f"{name} {t:.1f} ms ({gigabytes / t * 1e3:.1f} GB/s, {ms['packed'] / t:.2f}x packed)"
            for name, t in ms.items()
        )
    )


def _plain_rows_against_packed(weights: dict[torch.dtype, list[torch.Tensor]], rows: list[int], repeats: int) -> None:
    print(f"{'dtype':>9} {'M':>4} {'packed ms':>10} {'plain ms':>9} {'plain/packed':>13}")
    for dt, ws in weights.items():
        layers = [PackedLinear(w, keep_plain=True) for w in ws]
        for layer in layers:
            layer.plain_rows = PAIR_MAX_ROWS  # every row count here, to show where it stops paying
        for m in rows:
            x = {i: torch.randn(m, i).to(dt) for i in (HIDDEN, FFN)}
            runs = {
                "packed": lambda x=x, ls=layers: [p.forward_packed(x[p.in_features]) for p in ls],
                "plain": lambda x=x, ls=layers: [p(x[p.in_features]) for p in ls],
            }
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(3):  # alternate, so that a noisy moment hits both
                for name, run in runs.items():
                    times[name].append(_median_ms(run, repeats))
            pk, pl = statistics.median(times["packed"]), statistics.median(times["plain"])
            print(f"{str(dt).removeprefix('torch.'):>9} {m:>4} {pk:>10.1f} {pl:>9.1f} {pk / pl:>12.2f}x")


if __name__ == "__main__":
    main()
