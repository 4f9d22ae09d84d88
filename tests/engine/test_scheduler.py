"""The scheduler, driven by a fake engine loop that checks the KV cache it implies.

The fake "model" samples a token that is a function of the whole sequence,
so every completion is reproducible whatever the schedule (preemption,
chunking, prefix hits, speculation) and can be compared with a plain
reference loop. A fake KV cache records, for every slot written, which token
prefix it holds: a step may only read slots holding its own prefix, and may
only write blocks no other sequence holds. Speculating decodes get proposals
that are partly wrong, so rejected tokens' K/V land in the cache and must
never be read or shared.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from servelm.engine.block_manager import BlockManager
from servelm.engine.config import EngineConfig
from servelm.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from servelm.engine.sequence import Sequence, SequenceStatus


def next_token(tokens: list[int]) -> int:
    return (sum(tokens) * 7 + len(tokens)) % 11


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class FakeEngine:
    """Schedules, "runs" and updates steps the way the real engine does."""

    def __init__(
        self, num_blocks: int, enable_prefix_caching: bool = True, spec_tokens: int = 0, wrong_every: int = 2, **config
    ):
        self.config = EngineConfig(enable_prefix_caching=enable_prefix_caching, **config)
        self.spec_tokens = spec_tokens  # each new sequence's num_speculative_tokens
        self.wrong_every = wrong_every  # how often a proposed token is wrong (see propose)
        self.proposed = self.accepted = 0
        self.bm = BlockManager(num_blocks, self.config.block_size, enable_prefix_caching)
        self.sched = Scheduler(self.config, self.bm)
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}
        self.finished: dict[int, list[int]] = {}  # seq_id -> generated tokens
        self.next_id = 0
        self.steps = 0
        self.admissions: list[int] = []  # seq ids in the order they were (re)admitted

    def add(self, prompt: list[int], max_tokens: int, request_id: str | None = None, arrival: float = 0.0):
        rid = request_id or f"r{self.next_id}"
        seq = Sequence(
            self.next_id, rid, prompt, len(prompt), max_tokens, arrival, num_speculative_tokens=self.spec_tokens
        )
        self.next_id += 1
        self.sched.add(seq)
        return seq

    def check(self) -> None:
        """Invariants that hold between steps."""
        self.bm.check_invariants()
        held = Counter(b for s in self.sched.running for b in s.block_table)
        assert all(not s.block_table for s in self.sched.waiting)
        assert held == Counter({b.block_id: b.ref_count for b in self.bm.blocks if b.ref_count})
        assert len(self.sched.running) <= self.config.max_num_seqs

    def step(self) -> SchedulerOutput:
        waiting_before = {id(s) for s in self.sched.waiting}
        running_before = len(self.sched.running)
        out = self.sched.schedule()
        self.steps += 1
        self.check()
        scheduled = out.prefills + out.decodes
        assert len({id(s.seq) for s in scheduled}) == len(scheduled)
        for seq in out.preempted:
            assert seq.status is SequenceStatus.WAITING and seq.block_table == []
            assert seq.num_computed_tokens == 0
        self.admissions += [s.seq.seq_id for s in out.prefills if id(s.seq) in waiting_before]
        for d in out.decodes:
            assert d.num_new_tokens == 1 and d.seq.num_computed_tokens == d.seq.num_tokens - 1
            assert d.num_lookahead <= d.seq.max_tokens - d.seq.num_generated_tokens - 1
            if d.num_lookahead:
                assert running_before <= self.config.speculative_max_batch_size
                d.propose(self.propose(d.seq, d.num_lookahead))
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        for sch in scheduled:
            self._run(sch)
        sampled = {s.seq.seq_id: self.verify(s.seq.token_ids, s.proposal) for s in scheduled if s.is_sampling}
        for seq in self.sched.update_from_output(out, sampled):
            assert (seq.finish_reason, seq.num_generated_tokens) == ("length", seq.max_tokens)
            self.finished[seq.seq_id] = seq.generated_token_ids
        self.check()
        return out

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to ``k`` tokens (sometimes fewer, sometimes none): the true continuation, every
        ``wrong_every``th token wrong (1: all wrong)."""
        tokens = list(seq.token_ids)
        proposal = []
        for j in range(min(k, (seq.num_tokens + seq.seq_id) % (k + 2))):
            right = next_token(tokens)
            token = (right + 1) % 11 if (seq.num_tokens + j) % self.wrong_every == 0 else right
            proposal.append(token)
            tokens.append(token)
        return proposal

    def verify(self, tokens: list[int], proposal: list[int]) -> list[int]:
        """What the runner's greedy verification returns: the proposed tokens the model agrees with, then its own."""
        run = []
        for token in proposal:
            right = next_token(tokens + run)
            if token != right:
                break
            run.append(token)
        self.proposed += len(proposal)
        self.accepted += len(run)
        return [*run, next_token(tokens + run)]

    def _run(self, sch: ScheduledSeq) -> None:
        seq, bs = sch.seq, self.config.block_size
        assert sch.start == seq.num_computed_tokens and sch.num_new_tokens >= 1
        assert sch.start + sch.num_new_tokens <= seq.num_tokens + len(sch.proposal)
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_table) * bs >= seq.num_tokens + len(sch.proposal)
        for p in range(sch.start):  # attention reads every earlier slot
            slot = (seq.block_table[p // bs], p % bs)
            assert self.kv.get(slot) == tuple(seq.token_ids[: p + 1]), f"seq {seq.seq_id} misreads slot {p}"
        tokens = seq.token_ids + sch.proposal
        for p in range(sch.start, sch.start + sch.num_new_tokens):
            block = seq.block_table[p // bs]
            assert self.bm.blocks[block].ref_count == 1, f"seq {seq.seq_id} writes into shared block {block}"
            self.kv[(block, p % bs)] = tuple(tokens[: p + 1])

    def run(self, max_steps: int = 1000) -> None:
        while self.sched.has_unfinished():
            self.step()
            assert self.steps <= max_steps, "no progress"


# ---- sequence -----------------------------------------------------------


def test_sequence_basics():
    prompt = [1, 2, 3]
    seq = Sequence(0, "r", prompt, 3, max_tokens=2)
    assert seq.status is SequenceStatus.WAITING and seq.is_prefill
    seq.append_token(9)
    assert prompt == [1, 2, 3]  # the sequence owns a copy
    assert (seq.num_tokens, seq.num_generated_tokens, seq.last_token_id) == (4, 1, 9)
    assert seq.prompt_token_ids == [1, 2, 3] and seq.generated_token_ids == [9]
    seq.num_computed_tokens = 2
    assert seq.is_prefill  # two tokens still lack K/V
    seq.num_computed_tokens = 3
    assert not seq.is_prefill  # a decode: only the last token is left
    with pytest.raises(ValueError):
        Sequence(1, "r", [], 0, max_tokens=1)


def test_scheduled_seq_snapshots_survive_the_update():
    eng = FakeEngine(num_blocks=8, block_size=4)
    seq = eng.add([1, 2, 3, 4, 5], max_tokens=3)
    out = eng.sched.schedule()
    (sch,) = out.prefills
    assert (sch.start, sch.num_new_tokens, sch.is_sampling) == (0, 5, True)
    assert eng.sched.update_from_output(out, {seq.seq_id: [7]}) == []
    assert seq.token_ids == [1, 2, 3, 4, 5, 7] and seq.num_computed_tokens == 5
    assert (sch.start, sch.is_sampling) == (0, True)


@pytest.mark.parametrize(
    ("token", "finish_reason", "stop_reason"),
    [(50, "stop", 50), (60, "stop", None), (7, None, None)],
)
def test_the_update_ends_a_sequence_on_a_stop_token_or_its_eos(token, finish_reason, stop_reason):
    eng = FakeEngine(num_blocks=8, block_size=4)
    seq = Sequence(0, "r", [1, 2, 3], 3, max_tokens=5, stop_token_ids=frozenset({50}), eos_token_ids=frozenset({60}))
    eng.sched.add(seq)
    out = eng.sched.schedule()
    finished = eng.sched.update_from_output(out, {seq.seq_id: [token]})
    assert (seq.finish_reason, seq.stop_reason) == (finish_reason, stop_reason)
    assert finished == ([seq] if finish_reason else [])
    assert seq.is_finished == (finish_reason is not None)
    assert (eng.bm.num_free_blocks == 8) == seq.is_finished  # an ended sequence holds no block
    eng.check()


def test_the_update_skips_a_sequence_whose_sampling_failed():
    eng = FakeEngine(num_blocks=8, block_size=4)
    seq = eng.add([1, 2, 3], max_tokens=1)
    out = eng.sched.schedule()
    assert eng.sched.update_from_output(out, {}) == []  # computed, but no token to append
    assert (seq.num_tokens, seq.num_computed_tokens, seq.finish_reason) == (3, 3, None)


# ---- policy -------------------------------------------------------------


def test_chunked_prefill_shares_steps_with_decodes_within_budget():
    eng = FakeEngine(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    a = eng.add([1, 2, 3], max_tokens=10)
    out = eng.step()
    assert [(s.seq, s.num_new_tokens, s.is_sampling) for s in out.prefills] == [(a, 3, True)]
    b = eng.add(list(range(20)), max_tokens=2)
    chunks = []
    for _ in range(3):
        out = eng.step()
        assert [d.seq for d in out.decodes] == [a]  # the stream never stalls
        (p,) = out.prefills
        assert p.seq is b
        chunks.append((p.num_new_tokens, p.is_sampling))
        assert out.num_batched_tokens <= 8
    assert chunks == [(7, False), (7, False), (6, True)]
    assert b.num_generated_tokens == 1
    out = eng.step()
    assert sorted(d.seq.seq_id for d in out.decodes) == [a.seq_id, b.seq_id]
    eng.run()
    assert eng.finished == {a.seq_id: reference([1, 2, 3], 10), b.seq_id: reference(list(range(20)), 2)}


def test_decodes_take_budget_before_running_prefill_chunks():
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_batched_tokens=4)
    a = eng.add([1], max_tokens=20)
    b = eng.add([2], max_tokens=20)
    eng.step()  # both 1-token prompts fit the first step
    c = eng.add(list(range(30)), max_tokens=1)
    out = eng.step()
    assert {d.seq.seq_id for d in out.decodes} == {a.seq_id, b.seq_id}
    assert [(p.seq, p.num_new_tokens) for p in out.prefills] == [(c, 2)]
    out = eng.step()  # c is running mid-prefill now, still behind the decodes
    assert len(out.decodes) == 2 and out.prefills[0].num_new_tokens == 2


def test_max_num_seqs_is_respected():
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=2)
    seqs = [eng.add([i, i + 1], max_tokens=3 + i) for i in range(3)]
    out = eng.step()
    assert [p.seq for p in out.prefills] == seqs[:2]
    assert eng.sched.num_running == 2 and eng.sched.num_waiting == 1
    while seqs[0].seq_id not in eng.finished:
        assert seqs[2].status is SequenceStatus.WAITING
        eng.step()
    out = eng.step()
    assert [p.seq for p in out.prefills] == [seqs[2]]
    eng.run()
    assert len(eng.finished) == 3


def test_admission_is_first_come_first_served():
    eng = FakeEngine(num_blocks=4, block_size=2)
    a = eng.add([1, 2, 3, 4, 5], max_tokens=2)  # 3 blocks
    eng.step()
    big = eng.add([7] * 5, max_tokens=2)  # needs 3 blocks, 1 is free
    small = eng.add([9], max_tokens=1)  # would fit, but must not jump the queue
    out = eng.step()
    assert [p.seq for p in out.prefills] == []
    assert big.status is small.status is SequenceStatus.WAITING
    eng.run()
    assert eng.admissions == [a.seq_id, big.seq_id, small.seq_id]


def test_waiting_queue_orders_by_arrival_time():
    eng = FakeEngine(num_blocks=16, block_size=4)
    late = eng.add([1], max_tokens=1, arrival=2.0)
    early = eng.add([2], max_tokens=1, arrival=1.0)
    tie = eng.add([3], max_tokens=1, arrival=2.0)
    assert list(eng.sched.waiting) == [early, late, tie]


def test_preemption_recomputes_and_readmits_the_victim_first():
    eng = FakeEngine(num_blocks=4, block_size=2)
    a = eng.add([1, 2, 3], max_tokens=4)
    b = eng.add([4, 5, 6], max_tokens=4)
    eng.step()  # both admitted: 2 blocks each, the cache is full
    c = eng.add([8], max_tokens=1)  # queued behind, no room
    preempted = []
    while not preempted:
        preempted = eng.step().preempted
    assert preempted == [b]  # the youngest goes, the oldest keeps running
    assert eng.sched.num_preemptions == 1
    assert list(eng.sched.waiting) == [b, c]
    eng.run()
    assert eng.admissions == [a.seq_id, b.seq_id, b.seq_id, c.seq_id]
    assert b.num_cached_tokens > 0  # the recompute found its computed blocks
    assert eng.finished == {
        a.seq_id: reference([1, 2, 3], 4),
        b.seq_id: reference([4, 5, 6], 4),
        c.seq_id: reference([8], 1),
    }


def test_a_sequence_alone_without_room_preempts_itself():
    eng = FakeEngine(num_blocks=2, block_size=2)
    assert not eng.sched.can_ever_fit(3 + 5)  # the engine would reject it
    assert eng.sched.can_ever_fit(4)
    seq = eng.add([1, 2, 3], max_tokens=5)
    eng.step()
    eng.step()  # 4 tokens: still two blocks
    out = eng.step()  # the 5th token needs a third block
    assert out.preempted == [seq] and out.is_empty
    assert seq.status is SequenceStatus.WAITING and eng.bm.num_free_blocks == 2


def test_abort_frees_blocks_at_once():
    eng = FakeEngine(num_blocks=8, block_size=2, max_num_seqs=2)
    run1 = eng.add([1, 2, 3], max_tokens=5, request_id="x")
    run2 = eng.add([1, 2, 3], max_tokens=5, request_id="x")  # n=2: same request
    other = eng.add([4, 5], max_tokens=5, request_id="y")
    waiting = eng.add([6], max_tokens=5, request_id="z")
    eng.step()
    assert eng.bm.num_free_blocks < 8 and other.status is SequenceStatus.WAITING
    assert eng.sched.abort("x") == [run1, run2]
    assert run1.status is run2.status is SequenceStatus.FINISHED
    assert eng.bm.num_free_blocks == 8
    assert eng.sched.abort("z") == [waiting] and eng.sched.abort("nope") == []
    eng.check()
    eng.run()
    assert set(eng.finished) == {other.seq_id}


def test_the_update_skips_a_sequence_aborted_during_the_step():
    eng = FakeEngine(num_blocks=8, block_size=2)
    seq = eng.add([1, 2, 3], max_tokens=2)
    out = eng.sched.schedule()
    eng.sched.abort(seq.request_id)
    assert eng.sched.update_from_output(out, {seq.seq_id: [5]}) == []
    assert (seq.num_computed_tokens, seq.num_tokens, seq.finish_reason) == (0, 3, "abort")
    eng.check()
    assert eng.bm.num_free_blocks == 8


# ---- speculative decoding ---------------------------------------------------


def test_a_speculating_decode_reserves_its_lookahead_and_rolls_back_what_was_rejected():
    eng = FakeEngine(num_blocks=16, block_size=2, spec_tokens=4)
    seq = eng.add([1, 2, 3], max_tokens=20)
    expected = reference([1, 2, 3], 20)
    eng.step()  # the prefill samples the first token
    out = eng.sched.schedule()
    (d,) = out.decodes
    assert (d.num_lookahead, out.speculating) == (4, [d])
    assert len(seq.block_table) == eng.bm.num_blocks_for(seq.num_tokens + 4)
    wrong = (expected[3] + 1) % 11
    d.propose([expected[1], expected[2], wrong, expected[4]])
    assert d.num_new_tokens == 5 and out.num_batched_tokens == 5
    eng._run(d)
    run = eng.verify(seq.token_ids, d.proposal)
    assert run == expected[1:4]  # two kept, then the model's own token where the third was wrong
    assert eng.sched.update_from_output(out, {seq.seq_id: run}) == []
    assert seq.generated_token_ids == expected[:4]
    assert seq.num_computed_tokens == seq.num_tokens - 1  # the rejected tokens' K/V do not count
    assert len(seq.block_table) == eng.bm.num_blocks_for(seq.num_tokens)
    assert (eng.sched.num_drafts, eng.sched.num_draft_tokens, eng.sched.num_accepted_tokens) == (1, 4, 2)
    eng.check()
    eng.run()
    assert eng.finished[seq.seq_id] == expected
    assert eng.bm.num_free_blocks == 16


def test_an_empty_proposal_decodes_plainly_and_returns_the_lookahead():
    eng = FakeEngine(num_blocks=16, block_size=2, spec_tokens=3)
    seq = eng.add([1, 2, 3], max_tokens=5)
    eng.step()
    out = eng.sched.schedule()
    (d,) = out.decodes
    d.propose([])
    assert (d.num_new_tokens, d.proposal) == (1, [])
    eng._run(d)
    eng.sched.update_from_output(out, {seq.seq_id: [next_token(seq.token_ids)]})
    assert len(seq.block_table) == eng.bm.num_blocks_for(seq.num_tokens) and eng.sched.num_drafts == 0
    with pytest.raises(ValueError):
        ScheduledSeq(seq, 1, 2).propose([1, 2, 3])  # more than the slots reserved
    eng.check()


def test_speculation_stops_above_the_batch_threshold():
    eng = FakeEngine(num_blocks=32, block_size=2, spec_tokens=3, speculative_max_batch_size=2)
    seqs = [eng.add([1, 2, i], max_tokens=10) for i in range(3)]
    eng.step()
    assert [d.num_lookahead for d in eng.sched.schedule().decodes] == [0, 0, 0]
    eng2 = FakeEngine(num_blocks=32, block_size=2, spec_tokens=3, speculative_max_batch_size=2)
    for i in range(2):
        eng2.add([1, 2, i], max_tokens=10)
    eng2.step()
    assert [d.num_lookahead for d in eng2.sched.schedule().decodes] == [3, 3]
    assert len(seqs) == 3


def test_the_lookahead_is_capped_by_max_tokens_and_the_budget():
    eng = FakeEngine(num_blocks=32, block_size=2, spec_tokens=8, max_num_batched_tokens=4)
    seq = eng.add([1, 2], max_tokens=3)
    eng.step()
    (d,) = eng.sched.schedule().decodes
    assert d.num_lookahead == 1  # 3 tokens to generate: 1 sampled, this step's own, and one proposed
    eng2 = FakeEngine(num_blocks=32, block_size=2, spec_tokens=8, max_num_batched_tokens=4)
    eng2.add([1, 2], max_tokens=30)
    eng2.step()
    (d2,) = eng2.sched.schedule().decodes
    assert d2.num_lookahead == 3  # a budget of 4 tokens
    assert seq.num_generated_tokens == 1


def test_speculation_takes_no_block_another_decode_needs_and_never_preempts():
    # a holds 2 full blocks, b 2 blocks and a fifth token that needs the last free block: a's lookahead
    # would fit in that block, but taking it would preempt b.
    eng = FakeEngine(num_blocks=5, block_size=2, spec_tokens=2, enable_prefix_caching=False)
    a = eng.add([1, 2, 3], max_tokens=10)
    b = eng.add([4, 5, 6, 7], max_tokens=10)
    eng.step()
    assert (a.num_tokens, b.num_tokens, eng.bm.num_free_blocks) == (4, 5, 1)
    out = eng.sched.schedule()
    # b's own new block has a slot to spare after its fifth token.
    assert out.preempted == [] and [d.num_lookahead for d in out.decodes] == [0, 1]
    assert len(b.block_table) == 3
    eng.check()
    # A lookahead that fits in the sequence's own last block costs nothing and is taken.
    eng2 = FakeEngine(num_blocks=4, block_size=4, spec_tokens=3, enable_prefix_caching=False)
    c = eng2.add([1, 2, 3, 4, 5], max_tokens=10)
    d = eng2.add([6, 7, 8, 9, 10], max_tokens=10)
    eng2.step()
    assert eng2.bm.num_free_blocks == 0
    out2 = eng2.sched.schedule()
    assert out2.preempted == [] and [s.num_lookahead for s in out2.decodes] == [2, 2]
    assert (len(c.block_table), len(d.block_table)) == (2, 2)


@pytest.mark.parametrize(("stop", "finish_reason"), [(60, "stop"), (None, "length")])
def test_a_run_is_appended_up_to_the_token_that_ends_it(stop, finish_reason):
    eng = FakeEngine(num_blocks=16, block_size=2, spec_tokens=4)
    seq = Sequence(0, "r", [1, 2, 3], 3, max_tokens=4, eos_token_ids=frozenset({60}), num_speculative_tokens=4)
    eng.sched.add(seq)
    eng.step()
    out = eng.sched.schedule()
    (d,) = out.decodes
    assert d.num_lookahead == 2  # at most 4 tokens: 1 sampled, 1 plain, 2 proposed
    d.propose([7, 8])
    eng._run(d)
    run = [7, 60, 9] if stop else [7, 8, 9]  # EOS inside the accepted run / max_tokens reached by its last token
    assert eng.sched.update_from_output(out, {seq.seq_id: run}) == [seq]
    assert seq.generated_token_ids[1:] == ([7, 60] if stop else [7, 8, 9])
    assert seq.finish_reason == finish_reason and seq.block_table == []
    assert eng.bm.num_free_blocks == 16
    eng.bm.check_invariants()


# ---- properties ---------------------------------------------------------


@dataclass
class Req:
    prompt: list[int]
    max_tokens: int
    n: int
    arrival: int
    abort_at: int | None
    use_prefix_cache: bool


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(2, 16))
    config = dict(
        block_size=block_size,
        max_num_seqs=draw(st.integers(1, 4)),
        max_num_batched_tokens=draw(st.integers(1, 12)),
        enable_prefix_caching=draw(st.booleans()),
        speculative_max_batch_size=draw(st.integers(1, 4)),
        spec_tokens=draw(st.sampled_from([0, 0, 1, 2, 3])),
        wrong_every=draw(st.sampled_from([1, 2, 3, 1000])),
    )
    prefixes = [[], *draw(st.lists(st.lists(st.integers(0, 3), max_size=10), min_size=1, max_size=2))]
    reqs = []
    for _ in range(draw(st.integers(1, 8))):
        prompt = draw(st.sampled_from(prefixes)) + draw(st.lists(st.integers(0, 3), max_size=6))
        reqs.append(
            Req(
                prompt=prompt or [0],
                max_tokens=draw(st.integers(1, 8)),
                n=draw(st.sampled_from([1, 1, 1, 2])),
                arrival=draw(st.integers(0, 12)),
                abort_at=draw(st.none() | st.integers(0, 40)),
                use_prefix_cache=draw(st.sampled_from([True, True, True, False])),
            )
        )
    return num_blocks, config, reqs


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_simulated_engine_never_leaks_and_always_finishes(scenario):
    num_blocks, config, reqs = scenario
    eng = FakeEngine(num_blocks, **config)
    seqs: dict[int, list[Sequence]] = {}
    rejected, aborted = set(), set()
    total_work = sum(len(r.prompt) + r.max_tokens for r in reqs) * 2
    max_steps = 20 + max(r.arrival for r in reqs) + 4 * total_work * (len(reqs) + 1)
    while eng.sched.has_unfinished() or len(seqs) + len(rejected) < len(reqs):
        for i, r in enumerate(reqs):
            if r.arrival == eng.steps:
                if not eng.sched.can_ever_fit(len(r.prompt) + r.max_tokens):
                    rejected.add(i)  # what the engine does up front
                    continue
                seqs[i] = [eng.add(r.prompt, r.max_tokens, f"req{i}", arrival=eng.steps) for _ in range(r.n)]
                for s in seqs[i]:
                    s.use_prefix_cache = r.use_prefix_cache
            live = i in seqs and i not in aborted and not all(s.is_finished for s in seqs[i])
            if live and r.abort_at is not None and r.abort_at <= eng.steps:
                gone = eng.sched.abort(f"req{i}")
                assert {id(s) for s in gone} == {id(s) for s in seqs[i] if s.seq_id not in eng.finished}
                aborted.add(i)
                eng.check()
        eng.step()
        assert eng.steps <= max_steps, "livelock"
    for i, r in enumerate(reqs):
        if i in seqs and i not in aborted:
            for s in seqs[i]:
                assert eng.finished[s.seq_id] == reference(r.prompt, r.max_tokens)
    assert all(b.ref_count == 0 for b in eng.bm.blocks)
    assert eng.bm.num_free_blocks == num_blocks and eng.bm.usage == 0.0
    eng.bm.check_invariants()
    assert (eng.sched.num_draft_tokens, eng.sched.num_accepted_tokens) == (eng.proposed, eng.accepted)
    event(
        "speculated, some rejected"
        if eng.accepted < eng.proposed
        else "speculated, all kept"
        if eng.proposed
        else "no speculation"
    )
