"""Verification: the target model's logits at a speculating sequence's positions into the tokens it keeps.

A sequence that proposed ``m`` tokens has ``m + 1`` rows of target logits:
row ``j`` follows the sequence's tokens and the first ``j`` proposed ones.
Each row is processed as the sampler would process it at that position (its
penalties and min_tokens see the proposed tokens before it), then the
rejection sampler decides. The logprobs reported for each kept token are
the target's raw logprobs at its row, as without speculation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from servelm.engine.logits_processors import apply_logits_processors
from servelm.engine.sample_isolation import SampledRow
from servelm.engine.sampler import SamplingState, greedy_tokens, is_greedy, top_logprobs
from servelm.engine.spec_decode.rejection_sampler import greedy_accept, rejection_sample, sampling_distribution

logger = logging.getLogger(__name__)


@dataclass
class Speculation:
    """One speculating sequence in a step: its sampling state, its proposal, and the proposal's distributions
    (``[len(proposal), vocab]``, for a draft model's sampled proposal; None for a point mass or greedy)."""

    request_id: str
    state: SamplingState
    proposal: list[int]
    proposal_probs: torch.Tensor | None = None


def state_after(state: SamplingState, tokens: list[int]) -> SamplingState:
    """The sampling state of the position after the sequence's tokens and ``tokens`` (proposed ones), as
    the sampler will see it once they are appended."""
    return replace(state, token_ids=state.token_ids + tokens) if tokens else state


def row_states(state: SamplingState, proposal: list[int]) -> list[SamplingState]:
    """The sampling state at each of the ``len(proposal) + 1`` positions of a speculation's rows."""
    return [state_after(state, proposal[:j]) for j in range(len(proposal) + 1)]


def verify(logits: torch.Tensor, specs: list[Speculation]) -> list[list[SampledRow]]:
    """Each speculation's kept tokens and the target's next one, with their raw logprobs.

    ``logits`` holds ``len(s.proposal) + 1`` rows per speculation, in order.
    """
    logits = logits.float()
    raw = torch.log_softmax(logits, dim=-1)
    states = [rs for s in specs for rs in row_states(s.state, s.proposal)]
    processed = apply_logits_processors(logits, states)
    greedy = [is_greedy(st.params) for st in states]
    greedy_rows = [i for i, g in enumerate(greedy) if g]
    sampled_rows = [i for i, g in enumerate(greedy) if not g]
    choice: dict[int, int] = {}
    probs: dict[int, torch.Tensor] = {}
    if greedy_rows:
        index = torch.tensor(greedy_rows, device=logits.device)
        choice = dict(zip(greedy_rows, greedy_tokens(processed[index], raw[index]).tolist()))
    if sampled_rows:
        index = torch.tensor(sampled_rows, device=logits.device)
        dist = sampling_distribution(processed[index], raw[index], [states[i] for i in sampled_rows])
        probs = dict(zip(sampled_rows, dist))
    runs: list[list[int]] = []
    row0 = 0
    for s in specs:
        rows = range(row0, row0 + len(s.proposal) + 1)
        if greedy[row0]:
            runs.append(greedy_accept([choice[r] for r in rows], s.proposal))
        else:
            target = torch.stack([probs[r] for r in rows])
            runs.append(rejection_sample(target, s.proposal, s.proposal_probs, s.state.generator))
        row0 = rows.stop
    return _with_logprobs(raw, states, specs, runs)


def _with_logprobs(
    raw: torch.Tensor, states: list[SamplingState], specs: list[Speculation], runs: list[list[int]]
) -> list[list[SampledRow]]:
    # Token j of a run sits at row j of its speculation's rows.
    emitted_rows: list[int] = []
    emitted_tokens: list[int] = []
    row0 = 0
    for s, run in zip(specs, runs):
        emitted_rows += range(row0, row0 + len(run))
        emitted_tokens += run
        row0 += len(s.proposal) + 1
    index = torch.tensor(emitted_rows, device=raw.device)
    chosen = raw[index, torch.tensor(emitted_tokens, device=raw.device)].tolist()
    tops = top_logprobs(raw[index], [states[r] for r in emitted_rows])
    out: list[list[SampledRow]] = []
    i = 0
    for run in runs:
        out.append([(t, chosen[i + j], tops[i + j] if tops is not None else None) for j, t in enumerate(run)])
        i += len(run)
    return out


def verify_isolated(logits: torch.Tensor, specs: list[Speculation]) -> list[list[SampledRow] | None]:
    """:func:`verify`, where a speculation whose verification raises fails alone (None), as the sampler's
    isolation does for plain rows."""
    try:
        return list(verify(logits, specs))
    except Exception:
        logger.exception("verifying %d speculating sequences failed; verifying them one by one", len(specs))
    out: list[list[SampledRow] | None] = []
    row0 = 0
    for s in specs:
        rows = len(s.proposal) + 1
        try:
            out.append(verify(logits[row0 : row0 + rows], [s])[0])
        except Exception:
            logger.exception("verifying a speculation failed for request %s", s.request_id)
            out.append(None)
        row0 += rows
    return out
