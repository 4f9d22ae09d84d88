"""Which sequences speculate, and the proposer that fills in their proposals each step.

A request's sequences speculate unless one of these holds:

- the server runs no speculative method, or the request turned it off
  (``SamplingParams.speculative``);
- it samples (temperature > 0) with a seed: speculation runs only while the
  batch is small, and its accept/reject draws use the random stream
  differently from plain sampling, so the same seed would give different
  (equally likely) text depending on the server's load; without
  speculation a seeded request gives the same text in any batch;
- at a step, its sampling state carries a token mask (structured output):
  the mask is valid at the position after the sequence's tokens only, not
  after proposed ones, so the sequence decodes plainly.

best_of > n, logprobs and prompt logprobs do speculate: every sequence is
verified on its own, logprobs are the target's raw ones at each kept
token's row, and prompt logprobs come from prefill, which speculation
leaves alone.
"""

from __future__ import annotations

from typing import Protocol

import torch

from servelm.engine.config import EngineConfig
from servelm.engine.sampler import SamplingState, is_greedy
from servelm.engine.sampling_params import SamplingParams
from servelm.engine.scheduler import ScheduledSeq
from servelm.engine.spec_decode.draft import DraftModel, DraftProposer
from servelm.engine.spec_decode.ngram import ngram_proposal


def speculative_tokens(config: EngineConfig, params: SamplingParams) -> int:
    """How many tokens a sequence of a request with ``params`` may propose per step (0: it never speculates)."""
    if not config.speculative or not params.speculative:
        return 0
    if params.seed is not None and not is_greedy(params):
        return 0
    return config.num_speculative_tokens


class Proposer(Protocol):
    def propose(self, scheds: list[ScheduledSeq], sampling: dict[int, SamplingState]) -> dict[int, torch.Tensor]:
        """Fill each decode's proposal (at most ``num_lookahead`` tokens); returns seq_id -> the
        distributions sampled proposals were drawn from (none for point-mass or greedy proposals)."""
        ...


class NgramProposer:
    """Prompt lookup (:func:`ngram_proposal`) over each sequence's own tokens."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, scheds: list[ScheduledSeq], sampling: dict[int, SamplingState]) -> dict[int, torch.Tensor]:
        for s in scheds:
            s.propose(ngram_proposal(s.seq.token_ids, self.min_n, self.max_n, s.num_lookahead))
        return {}


def make_proposer(config: EngineConfig, draft: DraftModel | None) -> Proposer | None:
    """The proposer of ``config.speculative_method`` (None for none); draft mode needs the runner's ``draft``."""
    if config.speculative_method == "ngram":
        return NgramProposer(config.speculative_ngram_min, config.speculative_ngram_max)
    if config.speculative_method == "draft":
        if draft is None:
            raise ValueError("speculative_method draft needs the draft model")
        return DraftProposer(draft)
    return None


def propose(
    proposer: Proposer, scheds: list[ScheduledSeq], sampling: dict[int, SamplingState]
) -> dict[int, torch.Tensor]:
    """Run ``proposer`` over the decodes that may speculate this step (those without a token mask)."""
    free = [s for s in scheds if sampling[s.seq.seq_id].grammar is None]
    return proposer.propose(free, sampling) if free else {}
