"""The scheduler: which sequences run in the next step, and how many tokens each computes.

Continuous batching under two limits: at most ``max_num_seqs`` sequences
hold KV blocks, and one step computes at most ``max_num_batched_tokens``
tokens. Each step serves, in this order of budget priority:

1. running decodes (one token each, or one plus the proposed tokens it
   verifies when it speculates), so streams never stall behind prompts;
2. running sequences still mid-prefill (their next prompt chunk);
3. waiting sequences, first come first served, each admitted with a first
   chunk of its prompt (chunked prefill shares steps with decodes).

When a decode finds no free block, the most recently admitted running
sequence is preempted by recompute: its blocks are freed and it goes back to
the front of the queue, to be recomputed later (cheaply, if its blocks are
still in the prefix cache). The oldest running sequence is thus never
preempted for a younger one, which is what guarantees progress.

Speculative decoding: while at most ``speculative_max_batch_size`` sequences
run, a decode of a sequence that may speculate reserves budget and KV slots
for up to ``num_speculative_tokens`` proposed tokens after its last one
(never more than it may still generate, and never at the price of a
preemption); a proposer then fills in the proposal, and the step verifies it.
:meth:`Scheduler.update_from_output` keeps the accepted tokens and rolls
back the slots of the rejected ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from servelm.engine.block_manager import BlockManager
from servelm.engine.config import EngineConfig
from servelm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    """One sequence's work in a step: ``num_new_tokens`` tokens from ``start``.

    ``start`` and ``is_sampling`` are snapshots taken when the step is scheduled,
    so they stay right after :meth:`Scheduler.update_from_output` advances
    the sequence and appends its sampled token.

    A speculating decode has ``num_lookahead`` KV slots reserved after its last
    token; :meth:`propose` sets the (at most that many) proposed tokens the
    step computes after the last one, and ``num_new_tokens`` with them.
    """

    seq: Sequence
    num_new_tokens: int
    num_lookahead: int = 0
    proposal: list[int] = field(default_factory=list)
    start: int = field(init=False)  # seq.num_computed_tokens when scheduled
    # True when the chunk reaches the end of seq.token_ids, so the step samples the sequence's next token:
    is_sampling: bool = field(init=False)

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        self.is_sampling = self.start + self.num_new_tokens >= self.seq.num_tokens

    def propose(self, tokens: list[int]) -> None:
        """Set the proposed tokens this decode verifies (at most ``num_lookahead``)."""
        if len(tokens) > self.num_lookahead:
            raise ValueError(f"{len(tokens)} proposed tokens for {self.num_lookahead} reserved slots")
        self.proposal = list(tokens)
        self.num_new_tokens = 1 + len(tokens)


@dataclass
class SchedulerOutput:
    """The plan of one step: what to compute, and who lost their blocks."""

    prefills: list[ScheduledSeq] = field(default_factory=list)  # prompt chunks and recomputes
    decodes: list[ScheduledSeq] = field(default_factory=list)  # one token each, plus any proposal
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        """Prefills then decodes."""
        return self.prefills + self.decodes

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed in this step."""
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def speculating(self) -> list[ScheduledSeq]:
        """The decodes with slots reserved for proposed tokens."""
        return [s for s in self.decodes if s.num_lookahead]

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to compute."""
        return not self.prefills and not self.decodes


class Scheduler:
    """Owns the waiting queue and the running set; plans one step at a time.

    Sequences may be added or aborted between any two steps. The engine must
    reject up front any request that fails :meth:`can_ever_fit`: the
    scheduler assumes every sequence fits in the whole cache by itself.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.speculative_max_batch_size = config.speculative_max_batch_size
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order; preemption takes from the end
        self.num_preemptions = 0
        # Speculative decoding's totals: proposals verified, tokens proposed, of those accepted.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    # ---- queue management ----------------------------------------------

    @property
    def num_waiting(self) -> int:
        """Sequences queued for admission (new or preempted)."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Sequences holding KV blocks."""
        return len(self.running)

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` (prompt plus max_tokens) fits in the whole cache."""
        return self.block_manager.num_blocks_for(num_tokens) <= self.block_manager.num_blocks

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence, in ``arrival_time`` order (ties: order of adding)."""
        seq.status = SequenceStatus.WAITING
        # Usually the newest arrival: appending is the common case.
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].arrival_time > seq.arrival_time:
            i -= 1
        self.waiting.insert(i, seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Remove every sequence of ``request_id``, free its blocks, mark it FINISHED."""
        aborted = [s for s in self.waiting if s.request_id == request_id]
        aborted += [s for s in self.running if s.request_id == request_id]
        if not aborted:
            return []
        self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
        self.running = [s for s in self.running if s.request_id != request_id]
        for seq in aborted:
            self.block_manager.free(seq)  # a waiting sequence holds none: a no-op
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = seq.finish_reason or "abort"
        return aborted

    def finish(self, seq: Sequence, reason: str = "stop", stop_reason: str | int | None = None) -> None:
        """Retire a sequence that stopped: record why, free its blocks, drop it from the running set."""
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = seq.num_draft_computed = 0  # their K/V went with the blocks
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    # ---- one step --------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (see the module docstring for the policy)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1. Decodes, oldest first. Victims come from the young end, so a
        # sequence already scheduled here is never preempted afterwards.
        decoding = [s for s in self.running if not s.is_prefill]
        speculate = len(self.running) <= self.speculative_max_batch_size
        # Lookahead slots may only take blocks no decode needs for its own token.
        spare_blocks = bm.num_free_blocks - len(decoding)
        for seq in decoding:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if seq.num_computed_tokens >= seq.num_tokens:
                continue  # its sampled token was never appended: nothing to compute
            lookahead = self._lookahead(seq, budget, spare_blocks) if speculate else 0
            spare_blocks -= bm.num_blocks_for(seq.num_tokens + lookahead) - bm.num_blocks_for(seq.num_tokens)
            while not bm.can_append(seq):
                self._preempt(self.running[-1], out)
                if seq.status is not SequenceStatus.RUNNING:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: everything younger is gone already
            bm.append_slot(seq, lookahead)
            out.decodes.append(ScheduledSeq(seq, 1, lookahead))
            budget -= 1 + lookahead

        # 2. Running sequences mid-prefill: their blocks were all allocated
        # at admission, so a chunk needs only budget.
        for seq in self.running:
            if budget == 0:
                break
            if seq.is_prefill:
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                out.prefills.append(ScheduledSeq(seq, n))
                budget -= n

        # 3. Admit waiting sequences, strictly FCFS. Not in a step that had to
        # preempt: memory is short, and admitting would only churn.
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not bm.can_allocate(seq):
                break
            self.waiting.popleft()
            bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            out.prefills.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def _lookahead(self, seq: Sequence, budget: int, spare_blocks: int) -> int:
        """How many proposed tokens a decode of ``seq`` may verify: its own limit, the tokens it may still
        generate after the one this step samples anyway, the step's budget, and the slots that fit in the
        blocks it holds or needs anyway plus ``spare_blocks`` (so speculation never causes a preemption)."""
        room = seq.max_tokens - seq.num_generated_tokens - 1
        bm = self.block_manager
        holdable = max(len(seq.block_table), bm.num_blocks_for(seq.num_tokens)) + max(spare_blocks, 0)
        slots = holdable * bm.block_size - seq.num_tokens
        return max(0, min(seq.num_speculative_tokens, room, budget - 1, slots))

    def update_from_output(self, out: SchedulerOutput, sampled: Mapping[int, list[int]]) -> list[Sequence]:
        """After the model step, in one place: advance, append, finish, free.

        ``sampled`` maps seq_id to the run of tokens the sequence sampled:
        one token, or after a speculative decode the accepted proposed tokens
        and one more. Each scheduled sequence's computed tokens advance by
        its chunk (of a speculative decode, by its last token and the
        accepted ones); its run is appended token by token, up to the first
        that ends it (a stop token, its end-of-text token or its
        ``max_tokens``th), so nothing past an end is kept; its full verified
        blocks join the prefix cache; an ended sequence's blocks are freed
        and a speculating one's unneeded lookahead blocks rolled back.
        Returns the sequences that ended here. Stop strings are the output
        processor's: it finds them in the text and calls :meth:`finish`.
        """
        finished = []
        for sched in out.scheduled:
            seq = sched.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            run = sampled.get(seq.seq_id, ())  # empty mid-prefill, or when its sampling failed
            accepted = max(len(run) - 1, 0)
            seq.num_computed_tokens += sched.num_new_tokens - len(sched.proposal) + accepted
            if sched.proposal and run:
                self.num_drafts += 1
                self.num_draft_tokens += len(sched.proposal)
                self.num_accepted_tokens += accepted
            stop = None
            for token_id in run:
                seq.append_token(token_id)
                stop = seq.stop_for_token(token_id)
                if stop is not None:
                    break
            # After the append: a block is hashed once its tokens are verified and in the sequence.
            self.block_manager.mark_computed(seq)
            if stop is not None:
                self.finish(seq, *stop)
                finished.append(seq)
            elif sched.num_lookahead:
                self.block_manager.rollback(seq)
        return finished
