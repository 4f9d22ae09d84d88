"""The KV block manager: refcounts, prefix caching, eviction order, accounting."""

from __future__ import annotations

import pytest

from servelm.engine.block_manager import BlockManager
from servelm.engine.sequence import Sequence

BS = 4


def make_seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", tokens, num_prompt_tokens=len(tokens), max_tokens=4)


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """What a prefill of the whole sequence does to the bookkeeping."""
    seq.num_computed_tokens = seq.num_tokens
    bm.mark_computed(seq)


def refcounts(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


def test_allocate_covers_all_tokens_and_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(list(range(10)))  # 3 blocks: 4 + 4 + 2
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 3
    assert seq.num_computed_tokens == seq.num_cached_tokens == 0
    assert bm.num_free_blocks == 5
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    bm.free(seq)
    assert seq.block_table == []
    assert bm.num_free_blocks == 8
    assert refcounts(bm) == [0] * 8
    bm.check_invariants()


def test_shared_prefix_blocks_are_refcounted():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(list(range(10)), 0)
    bm.allocate(a)
    compute_all(bm, a)
    b = make_seq([*list(range(8)), 99, 98, 97], 1)  # same first two blocks
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    assert bm.num_free_blocks == 8 - 4
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    assert bm.num_free_blocks == 8 - 3
    bm.free(b)
    assert bm.num_free_blocks == 8
    bm.check_invariants()
    assert bm.prefix_cache_queries == 10 + 11
    assert bm.prefix_cache_hits == 8


def test_partial_match_stops_at_first_differing_block():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(list(range(12)), 0)
    bm.allocate(a)
    compute_all(bm, a)
    # Block 1 differs; block 2 equals a's block 2 but its chain does not.
    b = make_seq([0, 1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11, 12], 1)
    bm.allocate(b)
    assert b.num_cached_tokens == 4
    assert b.block_table[0] == a.block_table[0]
    assert not set(b.block_table[1:]) & set(a.block_table)


def test_cached_tokens_never_cover_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(list(range(8)), 0)
    bm.allocate(a)
    compute_all(bm, a)
    same = make_seq(list(range(8)), 1)  # exactly two full blocks, both cached
    bm.allocate(same)
    # The last token must be recomputed, and it is written into its own
    # block: the second block is not shared, so only 4 tokens are cached.
    assert same.num_cached_tokens == same.num_computed_tokens == 4
    assert same.num_computed_tokens <= same.num_tokens - 1
    assert same.block_table[0] == a.block_table[0]
    assert same.block_table[1] != a.block_table[1]
    longer = make_seq(list(range(9)), 2)
    bm.allocate(longer)
    assert longer.num_cached_tokens == 8  # 9th token is in a third block
    assert longer.block_table[:2] == a.block_table


def test_hash_is_registered_only_after_mark_computed():
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(13))
    a = make_seq(prompt, 0)
    bm.allocate(a)
    # Allocated but not computed: nothing may be shared yet.
    early = make_seq(prompt, 1)
    bm.allocate(early)
    assert early.num_cached_tokens == 0
    # First chunk of 6 tokens: block 0 complete, block 1 half written.
    a.num_computed_tokens = 6
    bm.mark_computed(a)
    mid = make_seq(prompt, 2)
    bm.allocate(mid)
    assert mid.num_cached_tokens == 4
    a.num_computed_tokens = 13
    bm.mark_computed(a)
    late = make_seq(prompt, 3)
    bm.allocate(late)
    assert late.num_cached_tokens == 12
    assert late.block_table[:3] == a.block_table[:3]
    bm.check_invariants()


def test_decode_blocks_become_shareable_when_full():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq([1, 2, 3], 0)
    bm.allocate(a)
    compute_all(bm, a)
    for t in (4, 5):  # two decode steps: append, then compute the new token
        a.append_token(t)
        assert bm.can_append(a)
        bm.append_slot(a)
        compute_all(bm, a)
    assert len(a.block_table) == 2  # 5 tokens: the 5th needed a new block
    b = make_seq([1, 2, 3, 4, 7], 1)
    bm.allocate(b)
    assert b.num_cached_tokens == 4
    assert b.block_table[0] == a.block_table[0]


def test_append_slot_adds_a_block_only_when_the_last_is_full():
    bm = BlockManager(num_blocks=2, block_size=BS)
    a = make_seq([1, 2, 3], 0)
    bm.allocate(a)
    a.append_token(4)
    bm.append_slot(a)
    assert len(a.block_table) == 1
    a.append_token(5)
    bm.append_slot(a)
    assert len(a.block_table) == 2
    assert bm.num_free_blocks == 0
    for t in (6, 7, 8):
        a.append_token(t)
        assert bm.can_append(a)
        bm.append_slot(a)
    a.append_token(9)
    assert not bm.can_append(a)
    with pytest.raises(RuntimeError):
        bm.append_slot(a)


def test_free_cached_blocks_are_evicted_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=BS)
    x = make_seq([1] * 4 + [0], 0)  # one full block + one partial block
    y = make_seq([2] * 4 + [0], 1)
    for s in (x, y):
        bm.allocate(s)
        compute_all(bm, s)
    (x_full, x_part), (y_full, y_part) = x.block_table, y.block_table
    bm.free(x)
    bm.free(y)
    assert bm.num_free_blocks == 4
    # Partial blocks cache nothing and go first; then x's cached block,
    # freed before y's. Each hand-out evicts the block's old hash.
    handed_out = []
    for i in range(3):
        filler = make_seq([100 + i], 10 + i)
        bm.allocate(filler)
        handed_out += filler.block_table
    assert handed_out == [y_part, x_part, x_full]
    assert bm._cached_prefix(make_seq([1] * 4 + [5], 20)) == []
    assert bm._cached_prefix(make_seq([2] * 4 + [5], 21)) == [y_full]
    bm.check_invariants()


def test_free_releases_the_tail_first():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_seq([*list(range(12)), 50], 0)  # 4 blocks would not fit
    assert not bm.can_allocate(a)
    a = make_seq(list(range(12)), 0)
    bm.allocate(a)
    compute_all(bm, a)
    table = list(a.block_table)
    bm.free(a)
    # The tail block goes first: a new sequence takes it, and the first two
    # blocks of the prefix still hit.
    other = make_seq([77], 1)
    bm.allocate(other)
    assert other.block_table == [table[2]]
    probe = make_seq([*list(range(8)), 1], 2)
    assert bm._cached_prefix(probe) == table[:2]
    bm.free(other)
    bm.check_invariants()


def test_can_allocate_does_not_count_reused_free_blocks_twice():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_seq([*list(range(8)), 1], 0)
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)  # two cached free blocks, one plain free block
    assert bm.num_free_blocks == 3
    reuse = make_seq([*list(range(8)), 1], 1)  # 3 blocks, 2 of them hits
    assert bm.can_allocate(reuse)
    # 4 blocks, 2 hits: needs 2 fresh blocks but the hits use up 2 of the 3
    # free ones. Counting free blocks naively (3 >= 2) would say yes.
    too_big = make_seq(list(range(8)) + [1] * 5, 2)
    assert not bm.can_allocate(too_big)
    with pytest.raises(RuntimeError):
        bm.allocate(too_big)
    bm.check_invariants()
    bm.allocate(reuse)
    assert bm.num_free_blocks == 0
    assert reuse.num_cached_tokens == 8


def test_usage_excludes_free_cached_blocks():
    bm = BlockManager(num_blocks=4, block_size=BS)
    assert bm.usage == 0.0
    a = make_seq([*list(range(8)), 1], 0)
    bm.allocate(a)
    assert bm.usage == pytest.approx(0.75)
    compute_all(bm, a)
    bm.free(a)
    assert bm.usage == 0.0
    b = make_seq([*list(range(8)), 2], 1)
    bm.allocate(b)  # reuses the two cached blocks + one fresh
    assert bm.usage == pytest.approx(0.75)


def test_reset_prefix_cache_forgets_free_blocks_only():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(list(range(9)), 0)
    b = make_seq([5] * 9, 1)
    for s in (a, b):
        bm.allocate(s)
        compute_all(bm, s)
    bm.free(a)
    bm.reset_prefix_cache()
    bm.check_invariants()
    assert bm._cached_prefix(make_seq(list(range(9)), 2)) == []
    assert len(bm._cached_prefix(make_seq([5] * 9, 3))) == 2  # b still holds them


def test_prefix_caching_disabled_never_shares():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_seq(list(range(9)), 0)
    bm.allocate(a)
    compute_all(bm, a)
    b = make_seq(list(range(9)), 1)
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert not set(a.block_table) & set(b.block_table)
    assert bm.prefix_cache_hits == 0


def test_a_sequence_can_opt_out_of_the_lookup_but_still_feeds_the_cache():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(list(range(9)), 0)
    bm.allocate(a)
    compute_all(bm, a)
    b = make_seq(list(range(9)), 1)
    b.use_prefix_cache = False
    bm.allocate(b)
    assert b.num_cached_tokens == b.num_computed_tokens == 0
    assert not set(a.block_table) & set(b.block_table)
    bm.free(a)
    bm.reset_prefix_cache()  # forget a's blocks: only b's can serve c
    compute_all(bm, b)  # its blocks hold correct K/V: shareable
    c = make_seq(list(range(9)), 2)
    bm.allocate(c)
    assert c.num_cached_tokens == 8
    assert c.block_table[:2] == b.block_table[:2]


def test_duplicate_content_computed_side_by_side_stays_consistent():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_seq(list(range(9)), 0), make_seq(list(range(9)), 1)
    bm.allocate(a)
    bm.allocate(b)  # no hits: nothing is computed yet
    compute_all(bm, a)
    compute_all(bm, b)  # same hashes: a's blocks stay registered
    bm.check_invariants()
    a_table = list(a.block_table)
    bm.free(a)
    bm.free(b)
    bm.check_invariants()
    c = make_seq(list(range(9)), 2)
    bm.allocate(c)
    assert c.num_cached_tokens == 8
    assert c.block_table[:2] == a_table[:2]


def test_a_duplicate_block_takes_over_an_evicted_hash_when_freed():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_seq(list(range(9)), 0), make_seq(list(range(9)), 1)
    bm.allocate(a)
    bm.allocate(b)
    compute_all(bm, a)
    compute_all(bm, b)  # a's blocks hold the registration
    bm.free(a)
    bm.reset_prefix_cache()  # a's content is gone from the cache
    b_table = list(b.block_table)
    bm.free(b)
    bm.check_invariants()
    c = make_seq(list(range(9)), 2)
    bm.allocate(c)
    assert c.block_table[:2] == b_table[:2]


def test_check_invariants_catches_corruption():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq([1, 2, 3], 0)
    bm.allocate(a)
    bm.check_invariants()
    bm.blocks[a.block_table[0]].ref_count = 0  # refcount 0 but not in the free queue
    with pytest.raises(AssertionError):
        bm.check_invariants()
    bm.blocks[a.block_table[0]].ref_count = 1
    bm.free(a)
    bm.check_invariants()
    stale = make_seq([1], 5)
    stale.block_table = [0]  # a table that was already freed
    with pytest.raises(RuntimeError):
        bm.free(stale)


def test_capacity_is_every_slot_of_every_block_and_bounds_what_can_ever_fit():
    bm = BlockManager(num_blocks=5, block_size=BS)
    assert bm.capacity_tokens == 20
    seq = make_seq(list(range(bm.capacity_tokens)))
    assert bm.num_blocks_for(seq.num_tokens) == bm.num_blocks  # the longest sequence takes the whole cache
    assert bm.num_blocks_for(bm.capacity_tokens + 1) > bm.num_blocks


# ---- speculative decoding: lookahead slots and their rollback ----------------


def test_lookahead_slots_are_allocated_and_rolled_back_to_the_tokens_kept():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(list(range(6)))  # 2 blocks
    bm.allocate(seq)
    compute_all(bm, seq)
    seq.num_computed_tokens = 5  # a decode: the last token is computed with the proposed ones
    assert bm.can_append(seq, 7) and not bm.can_append(seq, 6 * BS + 3)
    bm.append_slot(seq, 7)  # 6 tokens + 7 proposed: 4 blocks
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 4
    lookahead = seq.block_table[2:]
    # One proposed token accepted, plus the token the target drew: 8 tokens, 2 blocks.
    seq.append_token(6)
    seq.append_token(7)
    seq.num_computed_tokens = 7
    bm.mark_computed(seq)
    bm.rollback(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    assert all(bm.blocks[b].ref_count == 0 and bm.blocks[b].hash is None for b in lookahead)
    bm.check_invariants()
    # They cache nothing, so they are handed out before any block that does.
    other = make_seq([50, 51, 52, 53, 54], 1)
    bm.allocate(other)
    assert other.block_table == lookahead
    bm.free(other)
    bm.free(seq)
    assert bm.num_free_blocks == 8 and refcounts(bm) == [0] * 8
    bm.check_invariants()


def test_rollback_keeps_a_block_the_kept_tokens_reach_into():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(list(range(3)))
    bm.allocate(seq)
    seq.num_computed_tokens = 2
    bm.append_slot(seq, 4)  # 3 tokens + 4 proposed: 2 blocks
    assert len(seq.block_table) == 2
    for token in (3, 4):  # one accepted, one drawn: 5 tokens still need both blocks
        seq.append_token(token)
    bm.rollback(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    bm.check_invariants()


def test_rollback_refuses_a_hashed_or_shared_block():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(list(range(8)))
    bm.allocate(seq)
    compute_all(bm, seq)  # both blocks hashed
    del seq.token_ids[4:]  # a sequence whose tokens no longer reach its second, hashed block
    with pytest.raises(RuntimeError, match="shared or hashed"):
        bm.rollback(seq)
