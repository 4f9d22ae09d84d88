"""The sampler under hostile numbers: every row gets a valid token, and bad rows never touch good ones.

Hypothesis draws sampling values across the whole float64 range (subnormals,
1e±308, NaN, infinities) and logits with NaN, infinities and rows where
every token is banned. Values that SamplingParams refuses are the edge's
business (a 400 naming the field); every value it accepts must sample. A
second family bypasses validation altogether, as a bug elsewhere might, and
the sampler must still hand every row a token id in range.
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from servelm.engine.sampler import Sampler, SamplingState, make_generator
from servelm.engine.sampling_params import SamplingParams, SamplingParamsError

from .token_masks import FixedTokenMask

VOCAB = 12
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)

# Every kind of float64 that could reach a sampling parameter through JSON or Python.
EXTREME = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        [
            0.0,
            -0.0,
            5e-324,
            1e-320,
            1e-308,
            1e-45,
            1e-40,
            1.1754943e-38,
            1e-30,
            1e-5,
            0.5,
            1.0,
            2.0,
            100.0,
            3.4e38,
            3.5e38,
            1e39,
            1e308,
            -1e-40,
            -1e308,
        ]
    ),
)
LOGIT = st.one_of(
    st.floats(-1e4, 1e4),
    st.sampled_from([float("nan"), float("inf"), float("-inf"), 3.4e38, -3.4e38, 1e-45, 0.0]),
)


def _state(params: SamplingParams, *, seed: int | None = None, eos=(), mask=None, output=()) -> SamplingState:
    return SamplingState(
        params=params,
        token_ids=[1, 2, 3, *output],
        num_prompt_tokens=3,
        generator=make_generator(seed, "cpu"),
        eos_token_ids=set(eos),
        grammar=None if mask is None else FixedTokenMask(mask),
    )


@st.composite
def hostile_params(draw) -> SamplingParams | None:
    """Params built from extreme values; None when SamplingParams rejects them (the edge's 400)."""
    kwargs = {}
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if draw(st.booleans()):
            kwargs[name] = draw(EXTREME)
    if draw(st.booleans()):
        kwargs["top_k"] = draw(st.sampled_from([-1, 0, 1, 2, VOCAB - 1, VOCAB, VOCAB + 5, 10**9]))
    if draw(st.booleans()):
        kwargs["logit_bias"] = {draw(st.integers(0, VOCAB - 1)): draw(st.sampled_from([-100.0, 100.0, 1e-300]))}
    kwargs["min_tokens"] = draw(st.sampled_from([0, 3]))
    try:
        params = SamplingParams(**kwargs)
    except SamplingParamsError as exc:
        assert exc.param in kwargs or exc.param == "min_tokens", exc  # names a field the client sent
        return None
    params.check_vocab(VOCAB)
    return params


@st.composite
def hostile_row(draw) -> tuple[torch.Tensor, SamplingState]:
    params = draw(hostile_params())
    assume(params is not None)
    logits = torch.tensor(draw(st.lists(LOGIT, min_size=VOCAB, max_size=VOCAB)), dtype=torch.float32)
    how = draw(st.sampled_from(["plain", "all-banned-by-mask", "all-banned-by-min-tokens", "one-allowed"]))
    mask = eos = None
    if how == "all-banned-by-mask":
        mask = torch.zeros(VOCAB, dtype=torch.bool)
    elif how == "one-allowed":
        mask = torch.zeros(VOCAB, dtype=torch.bool)
        mask[draw(st.integers(0, VOCAB - 1))] = True
    elif how == "all-banned-by-min-tokens":
        eos = range(VOCAB)  # min_tokens bans every "EOS" until it is reached
        params.min_tokens = max(params.min_tokens, 1)
        if params.max_tokens is not None:
            params.max_tokens = max(params.max_tokens, params.min_tokens)
    return logits, _state(params, eos=eos or (), mask=mask)


GOOD_PARAMS = st.sampled_from(
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=1.0, top_k=3, seed=2),
        SamplingParams(temperature=0.7, min_p=0.1, repetition_penalty=1.3, seed=3),
    ]
)


def _good_rows(n: int) -> tuple[torch.Tensor, list[SamplingParams]]:
    gen = torch.Generator().manual_seed(n)
    return torch.randn(n, VOCAB, generator=gen) * 3, []


def _fresh(params: SamplingParams) -> SamplingState:
    # A seeded good row gets a fresh generator each time, so alone and batched draws compare.
    return _state(params, seed=params.seed)


def _valid(tokens: list[int]) -> bool:
    return all(isinstance(t, int) and 0 <= t < VOCAB for t in tokens)


@SETTINGS
@given(
    bad=st.lists(hostile_row(), min_size=1, max_size=4),
    good=st.lists(GOOD_PARAMS, min_size=1, max_size=3),
    order=st.randoms(use_true_random=False),
)
def test_hostile_rows_get_valid_tokens_and_leave_good_rows_alone(bad, good, order):
    good_logits, _ = _good_rows(len(good))
    alone = Sampler()(good_logits, [_fresh(p) for p in good])
    assert _valid(alone.token_ids)

    rows = [("bad", i) for i in range(len(bad))] + [("good", i) for i in range(len(good))]
    order.shuffle(rows)
    logits = torch.stack([bad[i][0] if kind == "bad" else good_logits[i] for kind, i in rows])
    states = [bad[i][1] if kind == "bad" else _fresh(good[i]) for kind, i in rows]
    mixed = Sampler()(logits, states)

    assert len(mixed.token_ids) == len(rows) and _valid(mixed.token_ids)
    for pos, (kind, i) in enumerate(rows):
        if kind == "good":
            assert mixed.token_ids[pos] == alone.token_ids[i], (good[i], pos)
            assert math.isclose(mixed.logprobs[pos], alone.logprobs[i], rel_tol=1e-6, abs_tol=1e-6)


@SETTINGS
@given(
    temperature=EXTREME,
    top_p=EXTREME,
    min_p=EXTREME,
    rep=EXTREME,
    freq=EXTREME,
    top_k=st.integers(-5, 10**6),
    logits=st.lists(LOGIT, min_size=VOCAB, max_size=VOCAB),
    seed=st.none() | st.integers(0, 2**64 - 1),
)
def test_even_unvalidated_params_give_a_valid_token(temperature, top_p, min_p, rep, freq, top_k, logits, seed):
    # As if validation had a hole: the values go straight into the dataclass.
    params = SamplingParams()
    params.temperature, params.top_p, params.min_p = temperature, top_p, min_p
    params.repetition_penalty, params.frequency_penalty, params.top_k = rep, freq, top_k
    row = torch.tensor(logits, dtype=torch.float32)
    good = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(7))
    good_params = SamplingParams(temperature=0.0)
    out = Sampler()(
        torch.stack([good[0], row, good[1]]), [_fresh(good_params), _state(params, seed=seed), _fresh(good_params)]
    )
    assert _valid(out.token_ids)
    assert out.token_ids[0] == int(good[0].argmax()) and out.token_ids[2] == int(good[1].argmax())


def test_a_degenerate_row_falls_back_to_its_greedy_token():
    nan, ninf = float("nan"), float("-inf")
    logits = torch.tensor(
        [
            [nan, 1.0, 5.0, nan],  # NaN poisons the softmax: greedy over the numbers
            [ninf, ninf, ninf, ninf],  # nothing left at all: the raw argmax
            [0.0, 3.4e38, 3.4e38, 1.0],  # overflows once divided by a small temperature
        ]
    )
    params = SamplingParams(temperature=1e-4, top_p=0.5)
    out = Sampler()(logits, [_state(params) for _ in range(3)])
    assert out.token_ids[0] == 2
    assert 0 <= out.token_ids[1] < 4
    assert out.token_ids[2] in (1, 2)


def test_every_token_banned_still_gives_a_token():
    logits = torch.tensor([[0.0, 9.0, 1.0, 2.0]])
    for params in (
        SamplingParams(temperature=0.0, min_tokens=1),
        SamplingParams(temperature=1.0, top_p=0.3, seed=5, min_tokens=1),
    ):
        out = Sampler()(logits, [_state(params, eos=range(4))])  # min_tokens bans every "EOS"
        assert out.token_ids == [1]  # the model's own favourite: nothing else distinguishes the tokens


def test_a_grammar_wins_over_the_stages_that_leave_no_token():
    # The grammar allows only token 2 (say, the end where it must stop), and min_tokens bans it:
    # the row falls back to the grammar's choice, never to the raw favourite (1) it forbids.
    logits = torch.tensor([[0.0, 9.0, 1.0, 2.0]])
    mask = torch.tensor([False, False, True, False])
    for params in (
        SamplingParams(temperature=0.0, min_tokens=1),
        SamplingParams(temperature=1.0, top_p=0.3, seed=5, min_tokens=1),
        SamplingParams(temperature=0.0, logit_bias={2: -100.0}),
    ):
        out = Sampler()(logits, [_state(params, eos={2}, mask=mask)])
        assert out.token_ids == [2], params
