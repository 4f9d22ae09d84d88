"""Turning the ``device`` and ``dtype`` settings into torch objects, for every engine."""

from __future__ import annotations

import functools
import logging
import time

import torch

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
    """True when this CPU multiplies bfloat16 matrices clearly faster than float32 ones.

    CPUs with bfloat16 instructions (AVX512-BF16, AMX) do, several times over;
    on others bfloat16 is emulated and slower, and on some that have the
    instructions oneDNN still runs it slower than float32. One matmul of a
    decoder's size in each dtype (a few tens of milliseconds in all) settles
    it, logged with its figures; ``--dtype`` pins the dtype without it.
    """
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
    """``auto`` is bfloat16 on CUDA and on a CPU whose bfloat16 matmuls are fast, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        fast = device.type == "cuda" or (device.type == "cpu" and cpu_prefers_bf16())
        return torch.bfloat16 if fast else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]
