"""The machine's limits, measured with PyTorch: bfloat16 and int8 GEMM peaks, memory read bandwidth.

bench/compare.sh runs this before the servers and bench/compare_table.py
divides each server's achieved FLOP/s and bytes/s by these figures::

    .venv/bin/python bench/machine_limits.py                    # print them
    .venv/bin/python bench/machine_limits.py --json limits.json

- bfloat16 GEMM: ``torch.nn.functional.linear`` of M x K activations and
  N x K weights for each ``--gemm`` shape (default 2048x896x4864 and
  2048x2048x8192: the MLP of Qwen2.5-0.5B and of Llama-3.2-1B on 2048 prefill
  tokens), plain and with the weight prepacked by oneDNN (servelm's
  ``PackedLinear``) where that is available. On a CPU without bfloat16
  instructions (AVX2) ``PackedLinear`` multiplies in float32 over the weight
  widened once, the rate a bfloat16 model runs at there; the line says so.
- int8 GEMM: ``torch._int_mm`` (int8 x int8 -> int32) and the quantized
  engines' linear (``onednn``, ``x86``, ``fbgemm``: uint8 activations times
  int8 weights, int32 accumulation, requantized output) on the same shapes.
  Integer multiply-adds count 2 ops, as FLOPs do. Beside them servelm's own
  W8A8 GEMM (``--quantization w8a8``; AVX512-VNNI CPUs), over bfloat16
  activations quantized per row inside the timing.
- Memory read: the sum of a ``--read-mib`` tensor in bfloat16 and in float32
  (bytes of the tensor / time), far larger than any cache.

Each candidate runs ``--repeats`` times after one warm-up call; its best time
counts, and each limit is the best candidate, named in the output. PyTorch's
thread count is the default (the cores), as in the servers. A candidate this
PyTorch lacks is reported as unavailable and skipped.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

DEFAULT_GEMMS = ["2048x896x4864", "2048x2048x8192"]
QUANTIZED_ENGINES = ("onednn", "x86", "fbgemm")


@dataclass
class Measurement:
    """One candidate's best rate (FLOP/s, ops/s or bytes/s), or why it could not run."""

    limit: str  # "bf16_gemm", "int8_gemm" or "read"
    how: str
    rate: float | None
    error: str | None = None


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls, after one warm-up call (oneDNN builds its kernels then)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def parse_gemm(text: str) -> tuple[int, int, int]:
    """``"2048x896x4864"`` -> (M, K, N)."""
    try:
        m, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a GEMM shape is MxKxN, got {text!r}") from None
    return m, k, n


def add_gemm_option(ap: argparse.ArgumentParser, defaults: list[str]) -> None:
    """``--gemm MxKxN ...``: the GEMM shapes to measure (this script's and bench/w8a8_gemm.py's)."""
    ap.add_argument(
        "--gemm",
        type=parse_gemm,
        nargs="+",
        default=[parse_gemm(g) for g in defaults],
        metavar="MxKxN",
        help="GEMM shapes (default: %(default)s)",
    )


def _bf16_candidates(m: int, k: int, n: int) -> list[tuple[str, Callable[[], Callable[[], object]]]]:
    def plain():
        x, w = torch.randn(m, k).to(torch.bfloat16), torch.randn(n, k).to(torch.bfloat16)
        return lambda: F.linear(x, w)

    def packed():
        from servelm.models.packed import PackedLinear, can_pack

        if not can_pack(torch.bfloat16, torch.device("cpu")):
            raise RuntimeError("oneDNN cannot prepack bfloat16 weights here")
        x, layer = torch.randn(m, k).to(torch.bfloat16), PackedLinear(torch.randn(n, k).to(torch.bfloat16))
        return lambda: layer(x)

    from servelm.platform.cpu import onednn_has_bf16

    widened = "" if onednn_has_bf16() else " (in float32)"
    return [(f"F.linear bf16 {m}x{k}x{n}", plain), (f"oneDNN prepacked bf16{widened} {m}x{k}x{n}", packed)]


def _int8_candidates(m: int, k: int, n: int) -> list[tuple[str, Callable[[], Callable[[], object]]]]:
    def int_mm():
        a = torch.randint(-128, 128, (m, k), dtype=torch.int8)
        b = torch.randint(-128, 128, (n, k), dtype=torch.int8).t()  # a weight stored N x K, as linear's
        return lambda: torch._int_mm(a, b)

    def quantized(engine: str):
        def make():
            import torch.ao.nn.quantized as nnq

            if engine not in torch.backends.quantized.supported_engines:
                raise RuntimeError(f"quantized engine {engine} not in this build")
            torch.backends.quantized.engine = engine
            layer = nnq.Linear(k, n)
            layer.set_weight_bias(torch.quantize_per_tensor(torch.randn(n, k), 0.05, 0, torch.qint8), None)
            x = torch.quantize_per_tensor(torch.randn(m, k), 0.05, 64, torch.quint8)
            return lambda: layer(x)

        return make

    def servelm_w8a8():
        from servelm import kernels

        native = kernels.cpu_kernels()
        packed = native.w8a8_pack(torch.randint(-127, 128, (n, k), dtype=torch.int8)) if native else None
        if packed is None:
            raise RuntimeError("servelm's W8A8 kernel does not run here (no kernels or no AVX512-VNNI)")
        x, scales = torch.randn(m, k).to(torch.bfloat16), torch.rand(n)
        return lambda: native.w8a8_linear(x, packed, scales, n)

    return (
        [(f"torch._int_mm {m}x{k}x{n}", int_mm)]
        + [(f"quantized linear ({e}) {m}x{k}x{n}", quantized(e)) for e in QUANTIZED_ENGINES]
        + [(f"servelm w8a8 (VNNI) {m}x{k}x{n}", servelm_w8a8)]
    )


def _read_candidates(mib: int) -> list[tuple[str, Callable[[], Callable[[], object]], int]]:
    def summed(dtype: torch.dtype):
        def make():
            t = torch.ones(mib * 2**20 // dtype.itemsize, dtype=dtype)
            return lambda: t.sum()

        return make

    return [
        (f"sum of {mib} MiB {dt}".replace("torch.", ""), summed(dt), mib * 2**20)
        for dt in (torch.bfloat16, torch.float32)
    ]


def _measure(limit: str, how: str, make: Callable[[], Callable[[], object]], work: float, repeats: int) -> Measurement:
    try:
        fn = make()
        with torch.inference_mode():
            return Measurement(limit, how, work / best_seconds(fn, repeats))
    except Exception as exc:  # a path this PyTorch or CPU lacks: named, not fatal
        return Measurement(limit, how, None, f"{type(exc).__name__}: {exc}".splitlines()[0])


def measure(gemms: list[tuple[int, int, int]], read_mib: int, repeats: int) -> list[Measurement]:
    """Every candidate of every limit, in order."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the quantized tensors' deprecation notice
        for m, k, n in gemms:
            out += [_measure("bf16_gemm", how, make, 2 * m * k * n, repeats) for how, make in _bf16_candidates(m, k, n)]
        for m, k, n in gemms:
            out += [_measure("int8_gemm", how, make, 2 * m * k * n, repeats) for how, make in _int8_candidates(m, k, n)]
        out += [_measure("read", how, make, work, repeats) for how, make, work in _read_candidates(read_mib)]
    return out


def summary(measurements: list[Measurement]) -> dict[str, object]:
    """The JSON document: each limit's best rate and how it was reached, and every measurement."""
    doc: dict[str, object] = {
        "cpu": _cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    for limit, rate_key in (
        ("bf16_gemm", "bf16_gemm_flops"),
        ("int8_gemm", "int8_gemm_ops"),
        ("read", "read_bytes_per_s"),
    ):
        ran = [m for m in measurements if m.limit == limit and m.rate is not None]
        best = max(ran, key=lambda m: m.rate or 0.0) if ran else None
        doc[rate_key] = best.rate if best else None
        doc[f"{limit}_how"] = best.how if best else None
    doc["measurements"] = [asdict(m) for m in measurements]
    return doc


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gemm_option(ap, DEFAULT_GEMMS)
    ap.add_argument(
        "--read-mib",
        type=int,
        default=1024,
        help="size of the tensor summed for the read bandwidth (default: %(default)s)",
    )
    ap.add_argument(
        "--repeats", type=int, default=5, help="timed calls per candidate; the best counts (default: %(default)s)"
    )
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    doc = summary(measure(args.gemm, args.read_mib, args.repeats))
    print(f"machine: {doc['cpu']}, {doc['threads']} threads, torch {doc['torch']}")
    for m in doc["measurements"]:  # type: ignore[union-attr]
        unit = {"bf16_gemm": "GFLOP/s", "int8_gemm": "GOP/s", "read": "GB/s"}[m["limit"]]
        figure = f"{m['rate'] / 1e9:8.1f} {unit}" if m["rate"] is not None else f"unavailable ({m['error']})"
        print(f"  {m['how']:<48} {figure}")
    print(
        f"bf16 GEMM peak {_giga(doc['bf16_gemm_flops'])} GFLOP/s, int8 GEMM peak {_giga(doc['int8_gemm_ops'])} GOP/s, "
        f"memory read {_giga(doc['read_bytes_per_s'])} GB/s"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0 if doc["bf16_gemm_flops"] and doc["read_bytes_per_s"] else 1


def _giga(value: object) -> str:
    return f"{value / 1e9:.1f}" if isinstance(value, float) else "-"


if __name__ == "__main__":
    sys.exit(main())
