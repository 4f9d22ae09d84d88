"""SamplingParams: defaults, normalisation, and an error naming the field for every bad value."""

from __future__ import annotations

import pytest

from servelm.engine.sampling_params import MAX_STOP_STRINGS, SamplingParams, SamplingParamsError

NAN, INF = float("nan"), float("inf")


def test_defaults_are_valid_and_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1, 1.0, 1.0, -1, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.skip_special_tokens and not p.greedy


def test_stop_string_becomes_a_list_and_sequences_are_copied():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None, stop_token_ids=None).stop_token_ids == []
    ids = [5, 6]
    p = SamplingParams(stop_token_ids=ids)
    assert p.stop_token_ids == ids and p.stop_token_ids is not ids


def test_best_of_defaults_to_n():
    assert SamplingParams(n=3).best_of == 3
    assert SamplingParams(n=2, best_of=5).best_of == 5


def test_logit_bias_keys_and_values_are_normalised():
    assert SamplingParams(logit_bias={"42": 5, 7: -100}).logit_bias == {42: 5.0, 7: -100.0}


def test_greedy():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.5, top_k=2).greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0, top_p=1e-9, top_k=0, min_p=1.0),
        dict(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1e-3),
        dict(max_tokens=None, min_tokens=1000),
        dict(max_tokens=5, min_tokens=5, logprobs=0, prompt_logprobs=20, seed=-3),
        dict(logit_bias={0: 100.0, 1: -100.0}, stop_token_ids=[0]),
    ],
)
def test_valid_edge_values(kwargs):
    SamplingParams(**kwargs)


INVALID = [
    ("n", 0),
    ("n", 1.5),
    ("best_of", 0),
    ("temperature", -0.1),
    ("temperature", NAN),
    ("temperature", INF),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", NAN),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", -3.0),
    ("frequency_penalty", NAN),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", INF),
    ("seed", 1.5),
    ("seed", "42"),
    ("max_tokens", 0),
    ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("logprobs", -1),
    ("logprobs", 1.5),
    ("prompt_logprobs", -1),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop", 3),
    ("stop", ["ok"] * (MAX_STOP_STRINGS + 1)),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["2"]),
    ("stop_token_ids", 7),
    ("logit_bias", {1: 101}),
    ("logit_bias", {1: NAN}),
    ("logit_bias", {"x": 1}),
    ("logit_bias", [1, 2]),
]


@pytest.mark.parametrize("field, value", INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_names_the_field(field, value):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field
    assert field in str(err.value)


def test_a_stop_list_at_the_limit_is_fine_and_a_huge_bad_value_is_not_echoed_whole():
    assert len(SamplingParams(stop=["ok"] * MAX_STOP_STRINGS).stop) == MAX_STOP_STRINGS
    bias = {t: 1.0 for t in range(50_000)} | {7: 1000.0}
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(logit_bias=bias)
    assert err.value.param == "logit_bias" and "[-100, 100]" in str(err.value)
    assert len(str(err.value)) < 500


def test_cross_field_checks_name_the_dependent_field():
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(n=3, best_of=2)
    assert err.value.param == "best_of"
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert err.value.param == "min_tokens"


def test_error_is_a_value_error():
    assert issubclass(SamplingParamsError, ValueError)
