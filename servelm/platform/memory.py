"""Where servelm's CPU memory comes from: glibc's malloc kept from handing activation memory back to
the kernel after every step, and huge pages for the memory decoding streams through. CPU only: the
engine calls ``keep_freed_memory`` and the weight layout ``huge_page_copies`` behind their device check.

By default glibc serves allocations above a moving threshold (at most 32 MiB)
with fresh ``mmap`` calls and trims its heap as soon as 128 KiB at the top are
free. A model step allocates and frees tens of megabytes of activations, so
every step would fault in (and the kernel zero) the same pages again, a large
share of a prefill step's time on CPU. Raising both thresholds once makes the
freed memory stay in the process for the next step, as tcmalloc and jemalloc
do (vLLM's CPU build preloads tcmalloc for the same reason). A prefill chunk's
MLP activations outgrow even the highest threshold on bigger models (2048 rows
of the Qwen2.5-0.5B shape's gate/up are 40 MB, the Llama-3.2-1B shape's 64 MB),
so once the weights and the KV cache are in place the engine turns ``mmap``
off for the rest (``heap_only``): every later block comes from the heap and
stays there. Loading keeps ``mmap`` on, so that a model's weights, and the
copies freed while laying them out, go back to the kernel when freed; the
copies below the mmap threshold (a small model's layers: SmolLM2's are a few
MiB each) land in the heap, whose raised trim threshold would keep them, so
``heap_only`` first hands the heap's free pages back (``malloc_trim``).

Decoding one sequence streams every weight once per token, which on 4 KiB
pages misses the TLB at every page; ``huge_page_copies`` places tensors
in a mapping that asks Linux for 2 MiB transparent huge pages (``madvise``,
granted where ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise``
or ``always``); bench/gemm.py times servelm's GEMV on both. The KV cache
comes from such a mapping too (``huge_page_zeros``): decoding reads each
sequence's blocks scattered over it, and on 4 KiB pages both the rate and
how it varied from process to process depended on where the kernel put them
(docs/BENCHMARKS.md). Its pages are written once when it is made, as
``torch.zeros`` writes its own: the cache's memory is taken at start, where a
shortage shows, not when its last blocks are first used.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import mmap
from typing import Any

import torch

logger = logging.getLogger(__name__)

# mallopt parameters, from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4

_MMAP_THRESHOLD = 32 << 20  # glibc's upper limit on 64-bit systems
_TRIM_THRESHOLD = 1 << 30
_MMAP_MAX = 65536  # glibc's default number of mmap-served blocks


def _libc_function(name: str) -> Any:
    """The C library's function ``name``; None where the C library is not glibc or lacks it."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def _mallopt(settings: dict[int, int]) -> bool:
    """Set glibc malloc parameters; False where the C library is not glibc or refuses one."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(mallopt(param, value) == 1 for param, value in settings.items())
    if not ok:
        logger.debug("mallopt refused %s", settings)
    return ok


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds, with ``mmap`` on for blocks above them (as for loading a
    model); False where the C library is not glibc."""
    return _mallopt({_M_MMAP_THRESHOLD: _MMAP_THRESHOLD, _M_TRIM_THRESHOLD: _TRIM_THRESHOLD, _M_MMAP_MAX: _MMAP_MAX})


def release_freed_memory() -> bool:
    """Hand the pages of glibc's free heap blocks back to the kernel (``malloc_trim``), whatever the trim
    threshold; False where the C library is not glibc."""
    trim = _libc_function("malloc_trim")
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True


def heap_only() -> bool:
    """Give back what loading freed (``release_freed_memory``), then serve every later allocation from
    glibc's heap, however large, so that freed blocks stay for the next step (``keep_freed_memory``
    first); False where the C library is not glibc."""
    return release_freed_memory() and _mallopt({_M_MMAP_MAX: 0})


_HUGE_PAGE = 2 << 20
_ALIGN = 64  # a cache line: each tensor starts on one


def _huge_page_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` zeroed bytes (uint8) in a fresh anonymous mapping, 2 MiB aligned, that asks the kernel
    for transparent huge pages (``madvise``); plain pages where the kernel or platform says no."""
    mem = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mem, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            mem.madvise(mmap.MADV_HUGEPAGE)
    view = ctypes.c_char.from_buffer(mem)
    start = (-ctypes.addressof(view)) % _HUGE_PAGE
    del view  # a live ctypes export would keep the mapping from ever closing
    return torch.frombuffer(mem, dtype=torch.uint8, count=nbytes, offset=start)


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor of ``shape`` and ``dtype`` in its own mapping, 2 MiB aligned, that asks for
    transparent huge pages (plain pages where the kernel or platform says no), every page already written
    (resident, as ``torch.zeros``'s are)."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return _huge_page_bytes(nbytes).view(dtype).view(shape).zero_()


def huge_page_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of CPU tensors, side by side in one mapping backed by transparent huge pages
    where the kernel grants them."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.nbytes // _ALIGN) * _ALIGN
    arena = _huge_page_bytes(total)
    copies = []
    for t, offset in zip(tensors, offsets):
        copy = arena[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
        copies.append(copy.copy_(t))
    return copies
