"""Sampling a batch so that one row's failure stays that row's.

The sampler is built not to fail on any valid parameters (degenerate rows
fall back to greedy), but if a batch still raises, every request in the
step would share the error. :func:`sample_isolated` then samples the rows
one by one: the rows that sample fine keep their token, and only the rows
that raise again are reported as failed, for the engine to fail their
requests alone.
"""

from __future__ import annotations

import logging

import torch

from servelm.engine.sampler import Sampler, SamplingState

logger = logging.getLogger(__name__)

# (token id, logprob, top logprobs or None): one row's result (the runner makes it a SampledToken).
SampledRow = tuple[int, float, list[tuple[int, float]] | None]


def sample_isolated(
    sampler: Sampler, logits: torch.Tensor, states: list[SamplingState], request_ids: list[str]
) -> list[SampledRow | None]:
    """One result per row of ``logits``: the sampled row, or None where sampling that row raised.

    ``request_ids`` name the rows' requests in the log, with each failure's traceback.

    The batch is sampled at once; only when that raises is each row sampled
    alone. A row sampled alone draws from its own generator (seeded rows) or
    the global one, so its token may differ from the batched draw, but it is
    a valid sample of the same distribution.
    """
    try:
        out = sampler(logits, states)
    except Exception:
        logger.exception("sampling a batch of %d rows failed; sampling them one by one", len(states))
    else:
        return [
            (out.token_ids[i], out.logprobs[i], out.top_logprobs[i] if out.top_logprobs is not None else None)
            for i in range(len(states))
        ]
    rows: list[SampledRow | None] = []
    for i, state in enumerate(states):
        try:
            one = sampler(logits[i : i + 1], [state])
        except Exception:
            logger.exception("sampling failed for request %s", request_ids[i])
            rows.append(None)
            continue
        rows.append((one.token_ids[0], one.logprobs[0], one.top_logprobs[0] if one.top_logprobs is not None else None))
    return rows
