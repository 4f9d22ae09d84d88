"""The scheduler: which sequences run in the next step, and how many tokens each computes.

Continuous batching under two limits: at most ``max_num_seqs`` sequences
hold KV blocks, and one step computes at most ``max_num_batched_tokens``
tokens. Each step serves, in this order of budget priority:

1. running decodes (one token each), so streams never stall behind prompts;
2. running sequences still mid-prefill (their next prompt chunk);
3. waiting sequences, first come first served, each admitted with a first
   chunk of its prompt (chunked prefill shares steps with decodes).

When a decode finds no free block, the most recently admitted running
sequence is preempted by recompute: its blocks are freed and it goes back to
the front of the queue, to be recomputed later (cheaply, if its blocks are
still in the prefix cache). The oldest running sequence is thus never
preempted for a younger one, which is what guarantees progress.
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
    """

    seq: Sequence
    num_new_tokens: int
    start: int = field(init=False)  # seq.num_computed_tokens when scheduled
    # True when the chunk reaches the end of seq.token_ids, so the step samples the sequence's next token:
    is_sampling: bool = field(init=False)

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        self.is_sampling = self.start + self.num_new_tokens >= self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """The plan of one step: what to compute, and who lost their blocks."""

    prefills: list[ScheduledSeq] = field(default_factory=list)  # prompt chunks and recomputes
    decodes: list[ScheduledSeq] = field(default_factory=list)  # one token each
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        """Prefills then decodes."""
        return self.prefills + self.decodes

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed in this step."""
        return sum(s.num_new_tokens for s in self.prefills) + len(self.decodes)

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
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order; preemption takes from the end
        self.num_preemptions = 0

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
        seq.num_computed_tokens = 0
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
        for seq in [s for s in self.running if not s.is_prefill]:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if seq.num_computed_tokens >= seq.num_tokens:
                continue  # its sampled token was never appended: nothing to compute
            while not bm.can_append(seq):
                self._preempt(self.running[-1], out)
                if seq.status is not SequenceStatus.RUNNING:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: everything younger is gone already
            bm.append_slot(seq)
            out.decodes.append(ScheduledSeq(seq, 1))
            budget -= 1

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

    def update_from_output(self, out: SchedulerOutput, sampled: Mapping[int, int]) -> list[Sequence]:
        """After the model step, in one place: advance, append, finish, free.

        Each scheduled sequence's computed tokens advance by its chunk and
        its full blocks join the prefix cache; a sequence that sampled
        (``sampled``: seq_id -> token id) gets its token appended, and ends
        (blocks freed) on a stop token, its end-of-text token or its
        ``max_tokens``. Returns the sequences that ended here. Stop strings
        are the output processor's: it finds them in the text and calls
        :meth:`finish`.
        """
        finished = []
        for sched in out.scheduled:
            seq = sched.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed_tokens += sched.num_new_tokens
            self.block_manager.mark_computed(seq)
            token_id = sampled.get(seq.seq_id)
            if token_id is None:
                continue  # mid-prefill, or its sampling failed
            seq.append_token(token_id)
            stop = seq.stop_for_token(token_id)
            if stop is not None:
                self.finish(seq, *stop)
                finished.append(seq)
        return finished
