"""The paged KV cache's bookkeeping: fixed-size blocks, refcounts, automatic prefix caching.

A sequence's K/V live in blocks of ``block_size`` token slots; its
``block_table`` lists them in order. A FULL block whose K/V are computed
gets a hash chained on the previous block's hash and its own tokens, so a
later sequence whose prompt starts with the same tokens reuses the block
instead of recomputing it.

Rules that keep sharing safe:

- A block is hashed (and so shareable) only once it is full AND its K/V are
  computed (:meth:`BlockManager.mark_computed`). With chunked prefill a
  block may be allocated steps before its tokens are computed; hashing it at
  allocation would let another sequence read slots nobody has written yet.
- Only full blocks are shared, and a sequence never reuses its last token's
  block: the last token is always recomputed (to get logits), so it must be
  written into a block nobody else reads. Shared blocks are read-only.
- A block whose refcount drops to 0 keeps its hash and stays reusable until
  it is handed out again. Free blocks are handed out least recently freed
  first, so recently used prefixes survive longest.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from servelm.engine.sequence import Sequence


def block_hash(prev_hash: bytes, token_ids: list[int]) -> bytes:
    """The content hash of a full block, chained on the previous block's hash.

    blake2b rather than ``hash()``: 128 bits make a collision (which would
    serve another prompt's K/V) practically impossible, and the value is
    the same in every process, so a router can compute it too.
    """
    return hashlib.blake2b(prev_hash + array("q", token_ids).tobytes(), digest_size=16).digest()


@dataclass
class Block:
    """One physical KV block: how many sequences hold it and what it caches."""

    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once full and computed; kept while free


class BlockManager:
    """Hands out KV blocks to sequences and shares full computed blocks by content."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with refcount 0, least recently freed first. An OrderedDict
        # so a cached free block can be taken out of the middle in O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[bytes, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens found cached

    # ---- queries -------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with refcount 0, cached or not."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by some sequence (free cached blocks are not used)."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        """The most tokens the whole cache holds: one sequence longer than this can never run."""
        return self.num_blocks * self.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids caching the longest reusable prefix of ``seq``.

        Only blocks that end at or before the second-to-last token count:
        the last token is recomputed, and its block must not be shared.
        """
        if not (self.enable_prefix_caching and seq.use_prefix_cache):
            return []
        hits: list[int] = []
        prev = b""
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            prev = block_hash(prev, seq.token_ids[i * bs : (i + 1) * bs])
            block_id = self._hash_to_block.get(prev)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether :meth:`allocate` would find blocks for all of ``seq``'s tokens."""
        return self._fits(seq, self._cached_prefix(seq))

    def _fits(self, seq: Sequence, hits: list[int]) -> bool:
        # A hit on a free cached block takes it out of the free pool, so it
        # cannot also serve as one of the fresh blocks.
        free_hits = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        fresh = self.num_blocks_for(seq.num_tokens) - len(hits)
        return fresh <= len(self._free) - free_hits

    def can_append(self, seq: Sequence, num_lookahead: int = 0) -> bool:
        """Whether :meth:`append_slot` can cover ``seq``'s newest token and ``num_lookahead`` more."""
        need = self.num_blocks_for(seq.num_tokens + num_lookahead) - len(seq.block_table)
        return need <= len(self._free)

    # ---- changes -------------------------------------------------------

    def _take_fresh(self) -> int:
        """Hand out the least recently freed block, evicting what it cached."""
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self._hash_to_block.get(block.hash) == block_id:
                del self._hash_to_block[block.hash]
            block.hash = None
        block.ref_count = 1
        return block_id

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all its tokens, reusing cached prefix blocks.

        Sets ``seq.num_cached_tokens`` and ``seq.num_computed_tokens`` to the
        tokens found cached (a multiple of ``block_size``, at most
        ``num_tokens - 1``). Call only when :meth:`can_allocate` is true.
        """
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        hits = self._cached_prefix(seq)
        if not self._fits(seq, hits):
            raise RuntimeError(f"not enough free KV blocks for sequence {seq.seq_id}")
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        fresh = self.num_blocks_for(seq.num_tokens) - len(hits)
        seq.block_table = hits + [self._take_fresh() for _ in range(fresh)]
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching and seq.use_prefix_cache:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_cached_tokens

    def append_slot(self, seq: Sequence, num_lookahead: int = 0) -> None:
        """Make sure a block exists for every token of ``seq`` (before a decode step), and for
        ``num_lookahead`` tokens after them (the proposed tokens a speculative step verifies)."""
        need = self.num_blocks_for(seq.num_tokens + num_lookahead) - len(seq.block_table)
        if need > len(self._free):
            raise RuntimeError(f"no free KV block for sequence {seq.seq_id}")
        for _ in range(need):
            seq.block_table.append(self._take_fresh())

    def rollback(self, seq: Sequence) -> None:
        """Free the blocks past those ``seq``'s tokens need: the lookahead slots of rejected proposed tokens.

        Those blocks hold unverified K/V only, so they were never hashed
        (:meth:`mark_computed` hashes verified tokens alone) and hold no
        other sequence: they go back as blocks that cache nothing.
        """
        keep = self.num_blocks_for(seq.num_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            if block.ref_count != 1 or block.hash is not None:
                raise RuntimeError(f"block {block_id} past sequence {seq.seq_id}'s tokens is shared or hashed")
            block.ref_count = 0
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)
        del seq.block_table[keep:]

    def mark_computed(self, seq: Sequence) -> None:
        """Register the hash of every full block of ``seq`` whose K/V are now computed.

        Call after each step that advanced ``seq.num_computed_tokens``.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        table = seq.block_table
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // bs
        # Hashed blocks form a prefix of the table: walk back to its end, so
        # each step hashes only the blocks it completed.
        start = num_full
        while start > 0 and self.blocks[table[start - 1]].hash is None:
            start -= 1
        prev = self.blocks[table[start - 1]].hash if start > 0 else b""
        assert prev is not None  # the walk above stopped at a hashed block or the start
        for i in range(start, num_full):
            block = self.blocks[table[i]]
            prev = block.hash = block_hash(prev, seq.token_ids[i * bs : (i + 1) * bs])
            # Two sequences may compute the same content side by side; the
            # first registration wins, the other block still chains by hash.
            self._hash_to_block.setdefault(prev, block.block_id)

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks and clear its table.

        Tail first, so a prefix's later blocks are evicted before its
        earlier ones (an early block is useful to more prompts). Blocks that
        cache nothing go to the front of the queue: they are worth nothing.
        """
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                # A duplicate of a block evicted meanwhile takes over its hash.
                if block.hash is not None:
                    self._hash_to_block.setdefault(block.hash, block_id)
                if block.hash is None or self._hash_to_block[block.hash] != block_id:
                    self._free.move_to_end(block_id, last=False)
        seq.block_table = []

    def reset_prefix_cache(self) -> None:
        """Forget the cached content of every free block.

        Blocks held by running sequences stay registered: their K/V are
        live and correct, and dropping them would only cost recompute.
        """
        for block_id in self._free:
            block = self.blocks[block_id]
            if block.hash is not None and self._hash_to_block.get(block.hash) == block_id:
                del self._hash_to_block[block.hash]
            block.hash = None

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (for tests)."""
        free_ids = [b.block_id for b in self.blocks if b.ref_count == 0]
        if any(b.ref_count < 0 for b in self.blocks):
            raise AssertionError(f"negative refcount: {[b for b in self.blocks if b.ref_count < 0]}")
        if sorted(self._free) != free_ids:
            raise AssertionError(f"free queue {list(self._free)} != refcount-0 blocks {free_ids}")
        for h, block_id in self._hash_to_block.items():
            if self.blocks[block_id].hash != h:
                raise AssertionError(f"block {block_id} registered under a hash it does not carry")
