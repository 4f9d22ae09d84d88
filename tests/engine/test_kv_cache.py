"""servelm.engine.kv_cache: the paged cache's tensors, one per layer."""

from __future__ import annotations

import torch

from servelm.engine.kv_cache import allocate_kv_caches, kv_block_bytes
from servelm.models.config import ModelConfig

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=120,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
)


def test_cpu_caches_are_zeroed_separate_and_on_huge_page_boundaries():
    for dtype, row in ((torch.bfloat16, 16), (torch.int8, 16 + 4)):  # int8 rows carry their float32 scale
        caches = allocate_kv_caches(CONFIG, 5, 16, dtype, torch.device("cpu"))
        assert len(caches) == 3
        for cache in caches:
            assert cache.shape == (2, 5, 16, 2, row) and cache.dtype == dtype and not cache.any()
            # each layer's cache in its own 2 MiB-aligned mapping that asks for transparent huge pages
            assert cache.data_ptr() % (2 << 20) == 0
        caches[0].fill_(1)
        assert not caches[1].any() and not caches[2].any()
        assert sum(c.nbytes for c in caches) == 5 * kv_block_bytes(CONFIG, 16, dtype)
