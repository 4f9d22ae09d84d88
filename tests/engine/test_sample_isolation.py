"""A batch whose sampling raises fails only the rows that raise on their own."""

from __future__ import annotations

import logging

import torch

from servelm.engine.sample_isolation import sample_isolated
from servelm.engine.sampler import Sampler, SamplingState
from servelm.engine.sampling_params import SamplingParams

CULPRIT_SEED = 4242


class FragileSampler(Sampler):
    """Raises whenever a batch holds the culprit's row, as a sampler bug tied to one request's params would."""

    def __call__(self, logits, states):
        if any(s.params.seed == CULPRIT_SEED for s in states):
            raise RuntimeError("index -1 is out of bounds (injected)")
        return super().__call__(logits, states)


def _state(params: SamplingParams) -> SamplingState:
    return SamplingState(params=params, token_ids=[], num_prompt_tokens=0, generator=None, eos_token_ids=set())


def test_only_the_culprit_row_fails(caplog):
    logits = torch.tensor([[0.0, 5.0, 1.0], [4.0, 0.0, 1.0], [0.0, 1.0, 6.0]])
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, seed=CULPRIT_SEED),
        SamplingParams(temperature=0.0, logprobs=1),
    ]
    with caplog.at_level(logging.ERROR, logger="servelm.engine.sample_isolation"):
        rows = sample_isolated(FragileSampler(), logits, [_state(p) for p in params], ["req-a", "req-b", "req-c"])
    assert rows[1] is None
    assert rows[0] is not None and rows[0][0] == 1 and rows[0][2] is None
    assert rows[2] is not None and rows[2][0] == 2 and rows[2][2] is not None and rows[2][2][0][0] == 2
    # The traceback is in the log under the culprit's request id; the good requests are not blamed.
    failures = [r for r in caplog.records if "sampling failed for request" in r.getMessage()]
    assert [r.getMessage() for r in failures] == ["sampling failed for request req-b"]
    assert failures[0].exc_info is not None


def test_a_healthy_batch_is_sampled_once():
    calls = []

    class Counting(Sampler):
        def __call__(self, logits, states):
            calls.append(len(states))
            return super().__call__(logits, states)

    logits = torch.tensor([[0.0, 5.0], [4.0, 0.0]])
    rows = sample_isolated(Counting(), logits, [_state(SamplingParams(temperature=0.0))] * 2, ["a", "b"])
    assert [r[0] for r in rows] == [1, 0] and calls == [2]
