"""The stages of sampling shared by greedy and random rows, each applied only to the rows that ask:
a request's logit_bias, the min_tokens ban on EOS and stop tokens, and the repetition, frequency and
presence penalties (in vLLM's order, after the grammar's mask). They touch only the tokens they name or
that a row has seen, never a row's whole vocabulary.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from servelm.engine.sampler import SamplingState


def apply_logits_processors(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Apply the stages shared by greedy and random rows; returns a new tensor when any applies."""
    vocab = logits.shape[1]
    bias_rows, ban_rows, penalty_rows = [], [], []
    for i, s in enumerate(states):
        p = s.params
        if p.logit_bias:
            bias_rows.append(i)
        if s.num_output_tokens < p.min_tokens:
            ban_rows.append(i)
        if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            penalty_rows.append(i)
    if not (bias_rows or ban_rows or penalty_rows):
        return logits

    dev = logits.device
    x = logits.clone()
    for i in bias_rows:
        ids, values = states[i].logit_bias(vocab, dev)
        x[i].index_add_(0, ids, values.to(x.dtype))
    for i in ban_rows:
        x[i, states[i].min_tokens_ban(vocab, dev)] = float("-inf")
    if penalty_rows:
        sub = [states[i] for i in penalty_rows]
        apply_penalties_(
            x,
            penalty_rows,
            [s.prompt_token_ids for s in sub],
            [s.params.prior_output_token_ids + s.output_token_ids for s in sub],
            [s.params.repetition_penalty for s in sub],
            [s.params.frequency_penalty for s in sub],
            [s.params.presence_penalty for s in sub],
        )
    return x


def apply_penalties_(
    logits: torch.Tensor,
    rows: list[int],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    repetition_penalty: list[float],
    frequency_penalty: list[float],
    presence_penalty: list[float],
) -> None:
    """Penalise, in place, the tokens row ``rows[i]`` of ``logits`` has already seen (the ``i``-th of each list).

    Repetition penalty (CTRL, as in vLLM/HF) covers prompt and output tokens:
    a positive logit is divided by it, a negative one multiplied. Frequency
    and presence penalties (OpenAI) cover output tokens only:
    ``logit -= frequency * count + presence * (count > 0)``. Only the tokens
    seen are read and written, each once: a few hundred a row, where a pass
    over every row's whole vocabulary cost milliseconds a step.
    """
    dev = logits.device
    owner = torch.tensor(rows, device=dev)
    if any(r != 1.0 for r in repetition_penalty):
        at, ids, _ = _distinct([p + o for p, o in zip(prompt_token_ids, output_token_ids)], logits.shape[1], dev)
        rep, row = torch.tensor(repetition_penalty, device=dev)[at], owner[at]
        seen = logits[row, ids]
        logits[row, ids] = torch.where(seen > 0, seen / rep, seen * rep)
    if any(f != 0.0 for f in frequency_penalty) or any(p != 0.0 for p in presence_penalty):
        at, ids, counts = _distinct(output_token_ids, logits.shape[1], dev)
        freq, pres = (torch.tensor(v, device=dev)[at] for v in (frequency_penalty, presence_penalty))
        row = owner[at]
        logits[row, ids] = logits[row, ids] - freq * counts.to(logits.dtype) - pres


def _distinct(token_ids: list[list[int]], vocab: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Each list's distinct token ids below ``vocab`` (a draft model's may be smaller) as three tensors: the
    list's index, the id, and how often the list holds it."""
    flat = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.long, device=device)
    owner = torch.repeat_interleave(
        torch.arange(len(token_ids), device=device), torch.tensor([len(t) for t in token_ids], device=device)
    )
    keys, counts = torch.unique((owner * vocab + flat)[flat < vocab], return_counts=True)
    return keys // vocab, keys % vocab, counts
