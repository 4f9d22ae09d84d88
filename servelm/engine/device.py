"""Turning the ``device`` and ``dtype`` settings into torch objects, for every engine."""

from __future__ import annotations

import functools
import logging
import time

import torch

from servelm.platform.cpu import onednn_emulates_bf16

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# auto takes bfloat16 on CPU only when its matmuls are at least this much faster.
_BF16_MARGIN = 1.5


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when present, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


def _matmul_seconds(dtype: torch.dtype) -> float:
    """The best of three timings of one [128, 1024] x [1024, 2048] matmul in ``dtype`` on CPU."""
    with torch.inference_mode():
        x = torch.randn(128, 1024).to(dtype)
        w = torch.randn(2048, 1024).to(dtype)
        times = []
        for _ in range(4):  # the first call pays oneDNN's set-up
            start = time.perf_counter()
            torch.nn.functional.linear(x, w)
            times.append(time.perf_counter() - start)
    return min(times[1:])


@functools.cache
def cpu_prefers_bf16() -> bool:
    """True when this CPU runs a bfloat16 model at least as fast as a float32 one.

    CPUs with bfloat16 instructions (AVX512-BF16, AMX) multiply bfloat16
    several times faster; on some that have them oneDNN still runs it slower
    than float32. One matmul of a decoder's size in each dtype (a few tens of
    milliseconds in all) settles it, logged with its figures. Where oneDNN has
    no bfloat16 instructions at all it would emulate them, 10x slower, but
    servelm's bfloat16 layers multiply in float32 there, over their weights
    widened once (``models/packed.py``): batches and prefill run at float32's
    rate, while one sequence's decoding reads the bfloat16 weights, half the
    bytes (on a Zen 1 with AVX2: 2.6x the one-stream speed, 0.92x at 32
    streams of 158-token prompts, and the KV cache holds twice the tokens;
    docs/BENCHMARKS.md), so bfloat16 is taken without a timing.
    ``--dtype`` pins the dtype.
    """
    if onednn_emulates_bf16():
        logger.info(
            "dtype auto: oneDNN has no bfloat16 instructions on this CPU, so bfloat16 layers multiply in float32 "
            "over weights widened once, and decoding one sequence reads half the bytes: using bfloat16"
        )
        return True
    bf16, fp32 = _matmul_seconds(torch.bfloat16), _matmul_seconds(torch.float32)
    prefers = bf16 * _BF16_MARGIN < fp32
    logger.info(
        "dtype auto: a [128, 1024] x [1024, 2048] matmul takes %.2f ms in bfloat16 vs %.2f ms in float32 on this CPU "
        "(bfloat16 must be %.1fx faster): using %s",
        bf16 * 1e3,
        fp32 * 1e3,
        _BF16_MARGIN,
        "bfloat16" if prefers else "float32",
    )
    return prefers


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and on a CPU that runs it at least as fast (``cpu_prefers_bf16``), else
    float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        fast = device.type == "cuda" or (device.type == "cpu" and cpu_prefers_bf16())
        return torch.bfloat16 if fast else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]
