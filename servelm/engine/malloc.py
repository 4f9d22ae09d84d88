"""Keep glibc's malloc from handing activation memory back to the kernel after every step.

By default glibc serves allocations above a moving threshold (at most 32 MiB)
with fresh ``mmap`` calls and trims its heap as soon as 128 KiB at the top are
free. A model step allocates and frees tens of megabytes of activations, so
every step would fault in (and the kernel zero) the same pages again: about a
third of a prefill step's time on CPU. Raising both thresholds once makes the
freed memory stay in the process for the next step, as tcmalloc and jemalloc
do (vLLM's CPU build preloads tcmalloc for the same reason).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# mallopt parameters, from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_MMAP_THRESHOLD = 32 << 20  # glibc's upper limit on 64-bit systems
_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    if not ok:
        logger.debug("mallopt refused the thresholds")
    return ok
