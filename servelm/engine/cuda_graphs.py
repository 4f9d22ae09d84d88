"""Decode steps replayed as CUDA graphs.

On a GPU, a decoding step of a small model is bound by the CPU launching
its kernels (some fifty a layer), not by the GPU running them: on an H100
the eager engine decoded one sequence slower than transformers' ``generate``
(docs/BENCHMARKS.md). A CUDA graph records a step's kernels once and
replays them all with one launch.

A replay runs on the shapes and addresses it was recorded with, so a step
is padded up to a batch bucket (a power of two, up to ``max_num_seqs``) and
its attention to a context bucket (a power of two of KV blocks, up to the
longest context); its inputs are copied into buffers that the graphs were
recorded on. The buckets are recorded at start-up, as vLLM records its
batch sizes: a bucket recorded mid-run stalls every stream for its
recording (on an H100, that made TTFT at c=32 worse with graphs than
without). Only the largest, whose padded attention would gather more than
``STARTUP_TOKENS`` tokens of K/V (long contexts at large batches), are
recorded the first time a step needs one instead. The padding rows write
their keys and values into a scratch block that no sequence owns and
attend to it alone; every op is row-wise or per sequence, so they never
reach a real row.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from servelm.engine.flat_batch import FlatBatch
from servelm.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


# Buckets whose steps gather at most this many tokens of K/V (batch x context) are recorded at start-up: all of
# SmolLM2's (64 sequences x 8192 tokens at most), while a 128k-context model's largest would each hold gigabytes
# for a step that may never come.
STARTUP_TOKENS = 1 << 20


def _buckets(limit: int) -> list[int]:
    """Every bucket up to ``limit``: the powers of two below it, and the limit itself."""
    return [1 << i for i in range(limit.bit_length()) if 1 << i < limit] + [limit]


class DecodeGraphs:
    """Runs decode-only steps of up to ``max_batch`` sequences through recorded CUDA graphs.

    ``kv_caches`` must hold one block more than the block manager hands out:
    block ``scratch_block`` takes the padding rows' keys and values.
    ``record=False`` runs the same padded steps eagerly, one model call on
    the buffers per step, so that machines without a GPU test the padding.
    """

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        max_batch: int,
        max_model_len: int,
        block_size: int,
        scratch_block: int,
        record: bool = True,
    ):
        device = kv_caches[0].device
        self.model, self.kv_caches, self.block_size, self.record = model, kv_caches, block_size, record
        self.max_batch = max_batch
        self.max_blocks = -(-max_model_len // block_size)
        self.scratch_slot = scratch_block * block_size
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slots = torch.full((max_batch,), self.scratch_slot, dtype=torch.long, device=device)
        self.lens = torch.ones(max_batch, dtype=torch.long, device=device)
        self.tables = torch.full((max_batch, self.max_blocks), scratch_block, dtype=torch.long, device=device)
        self.steps: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if record else None

    def record_all(self) -> None:
        """Record every bucket of up to ``STARTUP_TOKENS`` now, the largest first (later ones reuse its memory in
        the shared pool)."""
        start = time.perf_counter()
        sizes, blocks = _buckets(self.max_batch), _buckets(self.max_blocks)
        for size in reversed(sizes):
            for width in reversed(blocks):
                if (size, width) not in self.steps and size * width * self.block_size <= STARTUP_TOKENS:
                    self.steps[size, width] = self._recorded(size, width)
        if self.record:
            logger.info(
                "recorded %d CUDA graphs for decoding (batch sizes %s, KV blocks %s; %d larger when first needed) "
                "in %.1f s",
                len(self.steps),
                sizes,
                blocks,
                len(sizes) * len(blocks) - len(self.steps),
                time.perf_counter() - start,
            )

    def bucket(self, num_seqs: int, max_context: int) -> tuple[int, int] | None:
        """The (batch, KV blocks) bucket of a decode step, or None where it is larger than any."""
        blocks = -(-max_context // self.block_size)
        if num_seqs > self.max_batch or blocks > self.max_blocks:
            return None
        return min(_next_power_of_two(num_seqs), self.max_batch), min(_next_power_of_two(blocks), self.max_blocks)

    def run(self, batch: FlatBatch) -> torch.Tensor | None:
        """The hidden states of a decode-only ``batch``, or None where no bucket fits it (run it eagerly)."""
        meta = batch.meta
        n = len(meta.context_lens)
        key = self.bucket(n, max(meta.context_lens))
        # A table may hold blocks past its tokens (a speculative step's lookahead): wider than the buffer, eager.
        if key is None or meta.decode_lens is None or meta.block_tables.shape[1] > self.max_blocks:
            return None
        size = key[0]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.lens[:n].copy_(meta.decode_lens)
        self.tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        # Rows past n may hold an earlier step's real slots and lengths: a padding row writes to the
        # scratch block and reads one token (its stale table only names blocks it reads, never writes).
        self.slots[n:size].fill_(self.scratch_slot)
        self.lens[n:size].fill_(1)
        step = self.steps.get(key)
        if step is None:  # larger than start-up's: every stream waits while it is recorded
            step = self.steps[key] = self._recorded(*key)
            logger.info("recorded a CUDA graph for decoding %d sequences over %d KV blocks", *key)
        return step()[:n]

    def _recorded(self, size: int, blocks: int) -> Callable[[], torch.Tensor]:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            query_lens=[1] * size,
            # Attention reads `blocks` whole blocks of every row, masked past each row's own length.
            context_lens=[blocks * self.block_size] * size,
            block_tables=self.tables[:size, :blocks],
            num_prefills=0,
            num_prefill_tokens=0,
            decode_lens=self.lens[:size],
        )

        def forward() -> torch.Tensor:
            hidden: torch.Tensor = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
            return hidden

        if not self.record:
            return forward
        # Warm-up on a side stream first (cuBLAS and the attention kernels set themselves up outside
        # a capture). The buffers hold this step's inputs, so these runs write the K/V the replay will.
        # On the engine's GPU, which need not be the current one (cuda:1).
        start = time.perf_counter()
        with torch.cuda.device(self.input_ids.device):
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    forward()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = forward()
        logger.debug(
            "recorded a CUDA graph for decoding %d sequences over %d KV blocks in %.0f ms",
            size,
            blocks,
            (time.perf_counter() - start) * 1e3,
        )

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay
