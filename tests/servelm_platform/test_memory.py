"""servelm.platform.memory: glibc's malloc keeps freed activation memory for the next step; huge-page tensors.

(This folder is not named tests/platform: pytest would import it as the standard library's ``platform``.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import platform
import resource
from pathlib import Path

import pytest
import torch

from servelm.platform.memory import heap_only, huge_page_copies, keep_freed_memory

GLIBC = platform.libc_ver()[0] == "glibc"
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_ALWAYS = _THP.is_file() and "[always]" in _THP.read_text()


def test_thresholds_are_set_under_glibc_and_skipped_elsewhere():
    # mallopt returns 1 for each accepted setting; other C libraries have no mallopt to call.
    assert keep_freed_memory() is GLIBC


def _page_faults_touching(nbytes: int) -> int:
    """Minor page faults taken while allocating ``nbytes``, writing every page, and freeing them."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.empty(nbytes, dtype=torch.uint8)
    block.fill_(1)
    del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_a_step_sized_block_above_the_mmap_threshold_is_reused_only_once_mmap_is_off():
    # 40 MiB: the Qwen2.5-0.5B shape's gate/up activations for a 2048-token chunk, above glibc's 32 MiB cap.
    nbytes, pages = 40 << 20, (40 << 20) // 4096
    try:
        assert keep_freed_memory()
        faults = [_page_faults_touching(nbytes) for _ in range(3)]
        if not THP_ALWAYS:  # where every fresh mapping gets 2 MiB pages, a few dozen faults fill one
            assert min(faults) > pages // 2  # a fresh mapping each time, faulted in again
        assert heap_only()
        # The heap grows for the first few (glibc sorts the freed blocks into its bins, and an aligned
        # request asks for a little more than the block freed), then the same pages serve every step.
        faults = [_page_faults_touching(nbytes) for _ in range(20)]
        assert max(faults[-5:]) < pages // 10, faults
    finally:
        keep_freed_memory()  # mmap back on for the rest of the test process
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)  # and the heap this test grew handed back


def test_huge_page_copies_hold_their_values_past_the_callers_references():
    sources = [torch.randn(5, 7), torch.arange(33, dtype=torch.int8), torch.randn(2, 3).bfloat16()]
    copies = [huge_page_copies(sources)[i] for i in range(3)]  # no reference to the list remains
    gc.collect()  # the mapping lives as long as any tensor viewing it
    for source, copy in zip(sources, copies):
        assert copy.is_contiguous() and torch.equal(copy, source)
        assert copy.data_ptr() % 64 == 0  # each starts on a cache line: the kernels' vector loads
    copies[0].add_(1)
    assert torch.equal(copies[0], sources[0] + 1) and torch.equal(copies[1], sources[1])  # no overlap
