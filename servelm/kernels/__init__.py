"""Native CPU kernels, compiled from C on first use.

PyTorch has no CPU kernel for attention over a paged KV cache: the portable
path gathers every sequence's keys and values into a dense copy and calls
SDPA, whose CPU kernel spends most of its time on per-head overhead when
each sequence has a single query token. ``paged_attention.c`` reads the
cache blocks in place instead (3-5x faster per layer, see docs/BENCHMARKS.md).

The source is compiled once per machine with the system's C compiler
(``$CC``, default ``cc``) into the user's cache directory
(``$XDG_CACHE_HOME/servelm/kernels``, default ``~/.cache/servelm/kernels``)
and loaded with ctypes; ctypes releases the GIL for the call. The build uses
``-march=native``, so the file name carries a hash of the source, the flags,
the compiler's version and this CPU's feature flags. A freshly loaded library
is checked against PyTorch on a small case before it is used. Without a
compiler, or if the build or the check fails, ``decode_attention_kernel()``
returns None (with one warning) and callers keep the PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention.c")
_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
# Linked without -ffast-math: on older GCC that would link crtfastmath.o, whose
# constructor switches the whole process to flush-to-zero.
_LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "servelm" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str) -> Path:
    """Compile the source unless this machine's build is cached; returns the library's path."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), " ".join(_COMPILE_FLAGS + _LINK_FLAGS).encode(), version.encode(), _cpu_flags().encode()):
        key.update(part)
    target = _cache_dir() / f"paged_attention-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "paged_attention.o", Path(tmp) / "paged_attention.so"
        for cmd in (
            [compiler, *_COMPILE_FLAGS, "-c", str(_SOURCE), "-o", str(obj)],
            [compiler, str(obj), "-o", str(lib), *_LINK_FLAGS],
        ):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        os.replace(lib, target)  # atomic: a concurrent process sees no half-written file
    logger.info("compiled the CPU attention kernel into %s", target)
    return target


_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64
_DECODE_ARGS = [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, ctypes.c_int]


class DecodeAttention:
    """The loaded kernel: one query token per sequence over the paged cache (bfloat16 or float32)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {torch.bfloat16: lib.paged_decode_bf16, torch.float32: lib.paged_decode_f32}
        for fn in self._fns.values():
            fn.argtypes = _DECODE_ARGS
            fn.restype = None

    def supports(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        return query.device.type == "cpu" and query.dtype in self._fns and kv_cache.dtype == query.dtype

    def __call__(
        self, query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """``query`` ``[B, H, D]``; ``kv_cache`` ``[2, blocks, block_size, KVH, D]`` (contiguous);
        ``block_tables`` ``[B, max_blocks]`` int64; ``lens`` ``[B]`` int64, each in
        ``[1, max_blocks * block_size]``. Returns ``[B, H, D]``.

        The kernel trusts the tables: every entry a sequence reaches must be a
        block of this cache (the engine's block manager guarantees it).
        """
        batch, num_heads, head_dim = query.shape
        _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
        if cache_dim != head_dim or num_heads % num_kv_heads or lens.shape != (batch,):
            raise ValueError("decode attention: query, cache and lens shapes disagree")
        if not kv_cache.is_contiguous() or block_tables.dtype != torch.int64 or lens.dtype != torch.int64:
            raise ValueError("decode attention: the cache must be contiguous, tables and lens int64")
        query, block_tables, lens = query.contiguous(), block_tables.contiguous(), lens.contiguous()
        out = torch.empty_like(query)
        self._fns[query.dtype](
            query.data_ptr(),
            kv_cache[0].data_ptr(),
            kv_cache[1].data_ptr(),
            block_tables.data_ptr(),
            block_tables.shape[1],
            lens.data_ptr(),
            out.data_ptr(),
            batch,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            scale,
            torch.get_num_threads(),
        )
        return out


def _reference(query, kv_cache, block_tables, lens, scale):
    """The same attention in float64 PyTorch, for the self-check."""
    block_size = kv_cache.shape[2]
    group = query.shape[1] // kv_cache.shape[3]
    outs = []
    for b, n in enumerate(lens.tolist()):
        slots = [block_tables[b, t // block_size] * block_size + t % block_size for t in range(n)]
        flat = kv_cache.flatten(1, 2).double()
        k = flat[0, slots].repeat_interleave(group, 1)  # [n, H, D]
        v = flat[1, slots].repeat_interleave(group, 1)
        weights = (torch.einsum("hd,nhd->hn", query[b].double(), k) * scale).softmax(-1)
        outs.append(torch.einsum("hn,nhd->hd", weights, v))
    return torch.stack(outs)


def _self_check(kernel: DecodeAttention) -> None:
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 6, 4, 2, 16, generator=gen)
    tables = torch.tensor([[5, 1, 3], [0, 2, 4]])
    lens = torch.tensor([11, 3])
    query = torch.randn(2, 6, 16, generator=gen)
    expected = _reference(query, cache, tables, lens, 0.25).float()
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        got = kernel(query.to(dtype), cache.to(dtype), tables, lens, 0.25).float()
        if not torch.allclose(got, expected, atol=tol, rtol=tol):
            raise RuntimeError(f"{dtype} result differs from PyTorch's by {(got - expected).abs().max():.3g}")


@functools.cache
def decode_attention_kernel() -> DecodeAttention | None:
    """The CPU decode-attention kernel, built and checked on first call; None where it cannot be had."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        logger.warning("no C compiler (%s) found: decode attention on CPU takes the slower PyTorch path", compiler)
        return None
    try:
        kernel = DecodeAttention(ctypes.CDLL(str(_build(compiler))))
        _self_check(kernel)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("CPU attention kernel unavailable, using the slower PyTorch path: %s", exc)
        return None
    return kernel
