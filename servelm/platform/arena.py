"""One malloc arena for the whole process, set when servelm is imported (Linux with glibc).

glibc gives each new thread that allocates an arena of its own (up to 8 per
core), and an arena other than the main one is a chain of 64 MiB mappings
that are unmapped as soon as they are empty, whatever ``memory.py``'s
thresholds say (those hold for the main arena). The engine steps in a thread
of its own, and its model was loaded in another (``threads.py``), whose
arena it inherits once that thread ends. Every step's activations (tens of
megabytes) were then mapped, faulted in and zeroed again: on the dev VM a
prefill of 32 x 150 tokens on the Qwen2.5-0.5B shape took 30,000 to 160,000
page faults and about 1.5x the time it took on the main thread (6 faults).
With one arena every thread allocates from the main one.

The limit must be set before a second thread allocates: a thread keeps the
arena it got, and threads that end hand theirs on. So it is set at
``import servelm``, and a ``MALLOC_ARENA_MAX`` in the environment (read by
glibc at start-up) is left to rule.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_ARENA_MAX = -8  # from glibc's malloc.h


def one_arena() -> bool:
    """Limit glibc's malloc to its main arena; False where the C library is not glibc, or
    ``MALLOC_ARENA_MAX`` is set."""
    if not sys.platform.startswith("linux") or "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_ARENA_MAX, 1) == 1)
