"""servelm.platform.memory: glibc's malloc keeps freed activation memory for the next step; huge-page tensors.

(This folder is not named tests/platform: pytest would import it as the standard library's ``platform``.)
"""

from __future__ import annotations

import gc
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from servelm.platform.memory import huge_page_copies, huge_page_zeros, keep_freed_memory

GLIBC = platform.libc_ver()[0] == "glibc"
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_ALWAYS = _THP.is_file() and "[always]" in _THP.read_text()


def test_thresholds_are_set_under_glibc_and_skipped_elsewhere():
    # mallopt returns 1 for each accepted setting; other C libraries have no mallopt to call.
    assert keep_freed_memory() is GLIBC


# Run in a fresh interpreter: whether a block comes from a fresh mapping depends on what the process's
# heap already holds, and engines built earlier in the test process leave large free blocks in it.
_FAULTS = """
import json, resource, sys, torch
from servelm.platform.memory import heap_only, keep_freed_memory

def faults(nbytes):  # minor page faults taken while allocating nbytes, writing every page, freeing them
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.empty(nbytes, dtype=torch.uint8)
    block.fill_(1)
    del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

nbytes = int(sys.argv[1])
assert keep_freed_memory()
with_mmap = [faults(nbytes) for _ in range(3)]
assert heap_only()
print(json.dumps([with_mmap, [faults(nbytes) for _ in range(20)]]))
"""


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_a_step_sized_block_above_the_mmap_threshold_is_reused_only_once_mmap_is_off():
    # 40 MiB: the Qwen2.5-0.5B shape's gate/up activations for a 2048-token chunk, above glibc's 32 MiB cap.
    nbytes, pages = 40 << 20, (40 << 20) // 4096
    run = subprocess.run([sys.executable, "-c", _FAULTS, str(nbytes)], capture_output=True, text=True, check=True)
    with_mmap, heap = json.loads(run.stdout)
    if not THP_ALWAYS:  # where every fresh mapping gets 2 MiB pages, a few dozen faults fill one
        assert min(with_mmap) > pages // 2, with_mmap  # a fresh mapping each time, faulted in again
    # The heap grows for the first few (glibc sorts the freed blocks into its bins, and an aligned
    # request asks for a little more than the block freed), then the same pages serve every step.
    assert max(heap[-5:]) < pages // 10, heap


# The engine's thread, started after its model was loaded in another thread that has ended, running
# steps of varying sizes: each allocates and frees a layer's activations for a chunk of `rows` tokens.
_THREAD_FAULTS = """
import json, resource, threading, torch
import servelm  # limits malloc to one arena (servelm/platform/arena.py) unless MALLOC_ARENA_MAX is set
from servelm.platform.memory import heap_only, keep_freed_memory

def step(rows=2048):  # minor page faults this thread takes (Qwen2.5-0.5B shape, bfloat16)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(2):
        x = torch.empty(rows * 896 * 2, dtype=torch.uint8).fill_(1)
        gate_up = torch.empty(rows * 9728 * 2, dtype=torch.uint8).fill_(1)
        act = torch.empty(rows * 4864 * 2, dtype=torch.uint8).fill_(1)
        del gate_up
        down = torch.empty(rows * 896 * 2, dtype=torch.uint8).fill_(1)
        del x, act, down
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

assert keep_freed_memory()
loader = threading.Thread(target=step)
loader.start(); loader.join()
assert heap_only()
faults = []
rows = [2048, 2048, 704, 32, 32, 2048, 1500, 32, 2048, 2048, 704, 32, 2048, 2048]
engine = threading.Thread(target=lambda: faults.extend(step(r) for r in rows))
engine.start(); engine.join()
print(json.dumps(faults))
"""


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
@pytest.mark.parametrize("arenas", ["servelm's one", "glibc's default"])
def test_the_engines_thread_keeps_its_step_memory_in_one_arena(arenas):
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    if arenas == "glibc's default":
        env["MALLOC_ARENA_MAX"] = "8"  # servelm then leaves the arenas as glibc makes them
    run = subprocess.run([sys.executable, "-c", _THREAD_FAULTS], capture_output=True, text=True, check=True, env=env)
    faults = json.loads(run.stdout)
    gate_up_pages = 2048 * 9728 * 2 // 4096
    after_warm_up = sum(faults[6:])  # once the heap has grown to the largest step's blocks
    settled = gate_up_pages // 10
    if arenas == "servelm's one":
        assert after_warm_up < settled, faults
    elif not THP_ALWAYS:
        # The thread's own arena unmaps heaps as they empty: later steps fault their memory in again.
        # How much depends on where glibc's 64 MiB heaps happen to split the blocks (a whole gate/up
        # block and more each 2048-row step run alone, a quarter of one in the full suite's process),
        # so the control asserts only what the line above would reject.
        assert after_warm_up > settled, faults


# Loading's copies: blocks below the mmap threshold (a small model's layers) written and freed, all but the
# last (so that no free block sits at the top of the heap for an ordinary trim to take).
_LOADING = """
import json, torch
from servelm.platform.memory import heap_only, keep_freed_memory

def resident():  # bytes
    return int(open("/proc/self/statm").read().split()[1]) * 4096

assert keep_freed_memory()
blocks = [torch.empty(8 << 20, dtype=torch.uint8).fill_(1) for _ in range(48)]  # 384 MiB, 8 MiB each
before = resident()
del blocks[:-1]
freed = resident()
assert heap_only()
print(json.dumps([before, freed, resident()]))
"""


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_what_loading_freed_goes_back_to_the_kernel_once_steps_keep_their_memory():
    run = subprocess.run([sys.executable, "-c", _LOADING], capture_output=True, text=True, check=True)
    before, freed, after = json.loads(run.stdout)
    assert freed > before - (64 << 20), (before, freed)  # the raised trim threshold keeps the freed blocks
    assert after < freed - (300 << 20), (freed, after)  # heap_only hands their pages back


def test_huge_page_copies_hold_their_values_past_the_callers_references():
    sources = [torch.randn(5, 7), torch.arange(33, dtype=torch.int8), torch.randn(2, 3).bfloat16()]
    copies = [huge_page_copies(sources)[i] for i in range(3)]  # no reference to the list remains
    gc.collect()  # the mapping lives as long as any tensor viewing it
    for source, copy in zip(sources, copies):
        assert copy.is_contiguous() and torch.equal(copy, source)
        assert copy.data_ptr() % 64 == 0  # each starts on a cache line: the kernels' vector loads
    copies[0].add_(1)
    assert torch.equal(copies[0], sources[0] + 1) and torch.equal(copies[1], sources[1])  # no overlap


def test_huge_page_zeros_are_zeroed_2mib_aligned_and_each_its_own():
    cache = huge_page_zeros((2, 3, 16, 2, 68), torch.int8)  # an int8 KV cache's shape
    other = huge_page_zeros((5, 7), torch.bfloat16)
    assert cache.shape == (2, 3, 16, 2, 68) and cache.dtype == torch.int8 and cache.is_contiguous()
    assert other.shape == (5, 7) and other.dtype == torch.bfloat16
    assert not cache.any() and not other.any()
    assert cache.data_ptr() % (2 << 20) == 0 and other.data_ptr() % (2 << 20) == 0  # huge-page boundaries
    cache.fill_(3)
    assert (cache == 3).all() and not other.any()
