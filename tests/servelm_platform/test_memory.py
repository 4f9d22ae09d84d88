"""servelm.platform.memory: glibc's malloc keeps freed activation memory for the next step; huge-page tensors.

(This folder is not named tests/platform: pytest would import it as the standard library's ``platform``.)
"""

from __future__ import annotations

import gc
import platform

import torch

from servelm.platform.memory import huge_page_copies, keep_freed_memory


def test_thresholds_are_set_under_glibc_and_skipped_elsewhere():
    # mallopt returns 1 for each accepted setting; other C libraries have no mallopt to call.
    assert keep_freed_memory() is (platform.libc_ver()[0] == "glibc")


def test_huge_page_copies_hold_their_values_past_the_callers_references():
    sources = [torch.randn(5, 7), torch.arange(33, dtype=torch.int8), torch.randn(2, 3).bfloat16()]
    copies = [huge_page_copies(sources)[i] for i in range(3)]  # no reference to the list remains
    gc.collect()  # the mapping lives as long as any tensor viewing it
    for source, copy in zip(sources, copies):
        assert copy.is_contiguous() and torch.equal(copy, source)
        assert copy.data_ptr() % 64 == 0  # each starts on a cache line: the kernels' vector loads
    copies[0].add_(1)
    assert torch.equal(copies[0], sources[0] + 1) and torch.equal(copies[1], sources[1])  # no overlap
