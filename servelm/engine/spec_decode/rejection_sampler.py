"""Which proposed tokens to keep: the acceptance rule that keeps the target model's output distribution.

Greedy requests keep the proposed tokens that equal the target's greedy
choice and then take the target's own choice, so their output is the one
decoding without speculation gives. Sampled requests use rejection sampling
(Leviathan et al., "Fast Inference from Transformers via Speculative
Decoding", 2023; vLLM's rejection sampler): proposed token ``d`` at a
position with target distribution ``p`` and proposal distribution ``q`` is
kept with probability ``min(1, p(d) / q(d))``; at the first rejection a token
is drawn from the residual ``max(0, p - q)`` normalized, and when every
proposed token is kept one more is drawn from the next position's ``p``.
Every token then follows ``p`` exactly. An n-gram proposal is a point mass
(``q(d) = 1``): ``d`` is kept with probability ``p(d)``, and the residual is
``p`` without ``d``.
"""

from __future__ import annotations

import torch

from servelm.engine.sampler import SamplingState, greedy_tokens, random_choice, sampling_probs


def sampling_distribution(processed: torch.Tensor, raw: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """``[rows, vocab]``: the distribution the sampler draws each row's token from.

    ``processed`` holds the rows' logits after the logits processors and
    ``raw`` the model's own; a row whose distribution degenerates is the
    point mass on the greedy token the sampler falls back to.
    """
    probs, degenerate = sampling_probs(processed, states)
    if degenerate.any():
        bad = degenerate.nonzero()[:, 0]
        probs[bad] = 0.0
        probs[bad, greedy_tokens(processed[bad], raw[bad])] = 1.0
    return probs


def greedy_accept(target_tokens: list[int], proposal: list[int]) -> list[int]:
    """The proposed tokens up to the first that differs from the target's choice, then the target's choice.

    ``target_tokens`` holds the target's greedy token at each of the
    ``len(proposal) + 1`` positions.
    """
    accepted = 0
    while accepted < len(proposal) and proposal[accepted] == target_tokens[accepted]:
        accepted += 1
    return [*proposal[:accepted], target_tokens[accepted]]


def rejection_sample(
    target_probs: torch.Tensor,
    proposal: list[int],
    proposal_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The kept proposed tokens, then one token drawn by the target (see the module docstring).

    ``target_probs`` is ``[len(proposal) + 1, vocab]``: the target's
    distribution at each proposed position and the one after them.
    ``proposal_probs`` is ``[len(proposal), vocab]``: the distribution each
    proposed token was drawn from, or None for a point-mass proposal.
    Rows need not be normalized beyond summing to something positive.
    """
    m = len(proposal)
    if m:
        rows = torch.arange(m, device=target_probs.device)
        tokens = torch.tensor(proposal, device=target_probs.device)
        p = target_probs[rows, tokens]
        q = torch.ones_like(p) if proposal_probs is None else proposal_probs[rows, tokens].to(p.dtype)
        u = torch.empty(m, dtype=p.dtype, device=p.device).uniform_(generator=generator)
        # u < p / q without the division: u * q < p. Strict, so a token the target rules out is never kept.
        rejected = (u * q >= p).nonzero()
        accepted = int(rejected[0, 0]) if rejected.numel() else m
    else:
        accepted = 0
    target = target_probs[accepted]
    if accepted < m:
        if proposal_probs is None:
            residual = target.clone()
            residual[proposal[accepted]] = 0.0
        else:
            residual = (target - proposal_probs[accepted].to(target.dtype)).clamp_(min=0.0)
        # Nothing left only when q covers p everywhere, up to rounding: then p itself is the residual's limit.
        if residual.sum() > 0:
            target = residual
    token = int(random_choice(target[None], [generator])[0])
    return [*proposal[:accepted], token]
