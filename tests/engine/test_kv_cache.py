"""servelm.engine.kv_cache: the paged cache's tensors, one per layer."""

from __future__ import annotations

import torch

from servelm.engine.kv_cache import allocate_kv_caches, kv_block_bytes
from tests.models.test_llama import tiny_config


def test_cpu_caches_are_zeroed_separate_and_on_huge_page_boundaries():
    config = tiny_config()  # 2 layers, 2 KV heads of 8
    for dtype, row in ((torch.bfloat16, 8), (torch.int8, 8 + 4)):  # int8 rows carry their float32 scale
        caches = allocate_kv_caches(config, 5, 16, dtype, torch.device("cpu"))
        assert len(caches) == 2
        for cache in caches:
            assert cache.shape == (2, 5, 16, 2, row) and cache.dtype == dtype and not cache.any()
            # each layer's cache in its own 2 MiB-aligned mapping that asks for transparent huge pages
            assert cache.data_ptr() % (2 << 20) == 0
        caches[0].fill_(1)
        assert not caches[1].any()
        assert sum(c.nbytes for c in caches) == 5 * kv_block_bytes(config, 16, dtype)
