"""Structured outputs on the bundled model: every output follows its grammar, with every engine feature.

Outputs are sampled at temperature 0.7 (where a model left alone often
strays) and checked with an independent validator: ``jsonschema`` for
schemas, ``re.fullmatch`` for regexes.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from servelm import LLM, SamplingParams
from servelm.engine.grammar_matcher import GrammarMatcher
from servelm.engine.outputs import accumulate
from servelm.engine.structured_outputs import StructuredOutputsError, StructuredOutputsParams

pytestmark = pytest.mark.model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "role": {"enum": ["engineer", "doctor", "artist"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "role", "hobbies"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON: name, age, city, role and hobbies."}]


def constrained(**kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


def person_params(**kwargs) -> SamplingParams:
    return SamplingParams(
        **{"temperature": 0.7, "max_tokens": 160, "structured_outputs": constrained(json=PERSON), **kwargs}
    )


def assert_person(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, PERSON)
    return value


def chat_ids(llm: LLM, messages) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_special_tokens=False)


def test_json_schema_output_validates_ten_times_out_of_ten(llm):
    prompt = chat_ids(llm, ASK)
    outs = llm.generate([prompt] * 10, [person_params(seed=s) for s in range(10)])
    texts = [o.outputs[0].text for o in outs]
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        assert_person(out.outputs[0].text)
    assert len(set(texts)) > 1  # sampled, not one forced string


def test_regex_and_choice_hold(llm):
    prompt = chat_ids(llm, [{"role": "user", "content": "Give me a phone number and a colour."}])
    regex = r"\(\d{3}\) \d{3}-\d{4}"
    outs = llm.generate(
        [prompt] * 5, SamplingParams(temperature=0.7, max_tokens=30, structured_outputs=constrained(regex=regex))
    )
    for out in outs:
        assert re.fullmatch(regex, out.outputs[0].text) and out.outputs[0].finish_reason == "stop"
    choices = ["red", "green", "blue", "a shade of purple"]
    outs = llm.generate(
        [prompt] * 5, SamplingParams(temperature=0.7, max_tokens=30, structured_outputs=constrained(choice=choices))
    )
    assert all(o.outputs[0].text in choices for o in outs)


def test_json_object_and_ebnf_grammar(llm):
    prompt = chat_ids(llm, [{"role": "user", "content": "Reply with a small JSON object about cats."}])
    spec = constrained(json_object=True)
    params = SamplingParams(n=4, temperature=0.7, max_tokens=120, seed=3, structured_outputs=spec)
    choices = llm.generate([prompt], params)[0].outputs
    # A small model may write JSON past max_tokens: such a choice ends with "length", its tokens
    # still a path through the grammar; a choice that stopped is a whole object.
    for choice in choices:
        matcher = GrammarMatcher(llm.engine.grammars.compile(spec), llm.tokenizer.eos_token_ids)
        assert all(matcher.accept(t) for t in choice.token_ids), choice.text
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict), choice.text
        else:
            assert choice.finish_reason == "length" and len(choice.token_ids) == 120
    assert any(c.finish_reason == "stop" for c in choices)
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.7, max_tokens=20, structured_outputs=constrained(grammar=grammar))
    )[0]
    assert out.outputs[0].text in ("The answer is yes.", "The answer is no.")


def test_n_2_gives_each_choice_its_own_matcher(llm):
    out = llm.generate([chat_ids(llm, ASK)], person_params(n=2, seed=11))[0]
    assert len(out.outputs) == 2
    values = [assert_person(c.text) for c in out.outputs]
    assert values[0] != values[1]


def test_stop_strings_still_stop_a_constrained_output(llm):
    prompt = chat_ids(llm, [{"role": "user", "content": "Two words please."}])
    params = SamplingParams(
        temperature=0.7, max_tokens=20, stop=[" "], structured_outputs=constrained(regex="[a-z]{3,6} [a-z]{3,6}")
    )
    choice = llm.generate([prompt], params)[0].outputs[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == " "
    assert re.fullmatch("[a-z]{3,6}", choice.text)


def test_logprobs_stay_the_model_s_raw_logprobs(llm):
    prompt = chat_ids(llm, [{"role": "user", "content": "What is the capital of France?"}])
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=3))[0].outputs[0]
    forced = llm.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, structured_outputs=constrained(choice=["Zebra"])),
    )[0].outputs[0]
    assert forced.text == "Zebra"
    first_free, first_forced = free.logprobs[0], forced.logprobs[0]
    # The alternatives are those of the unconstrained distribution, which the grammar did not allow.
    assert [t.token_id for t in first_forced.top] == [t.token_id for t in first_free.top]
    assert first_forced.top[0].logprob == pytest.approx(first_free.top[0].logprob, abs=1e-4)
    assert first_forced.chosen.logprob < first_forced.top[0].logprob
    # The end of text the grammar then forced counts in the cumulative logprob, but has no logprobs entry
    # (it is not part of the text).
    assert forced.finish_reason == "stop" and len(forced.logprobs) == len(forced.token_ids) - 1
    assert forced.cumulative_logprob <= sum(p.chosen.logprob for p in forced.logprobs) + 1e-4


def test_max_tokens_truncates_with_length(llm):
    choice = llm.generate([chat_ids(llm, ASK)], person_params(max_tokens=6, seed=1))[0].outputs[0]
    assert choice.finish_reason == "length" and len(choice.token_ids) == 6
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.text)


def test_eos_comes_only_where_the_grammar_ends(llm):
    prompt = chat_ids(llm, [{"role": "user", "content": "Say hi."}])
    # ignore_eos cannot run past the grammar's end, and min_tokens cannot keep it from ending.
    for extra in ({"ignore_eos": True}, {"min_tokens": 10}):
        params = SamplingParams(
            temperature=0.7, max_tokens=30, structured_outputs=constrained(choice=["hi", "hello"]), **extra
        )
        choice = llm.generate([prompt], params)[0].outputs[0]
        assert choice.text in ("hi", "hello") and choice.finish_reason == "stop", extra


def test_constrained_and_unconstrained_requests_share_a_batch(llm):
    free_prompt = llm.tokenizer.encode("The three primary colors are")
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = llm.generate([free_prompt], free)[0].outputs[0].token_ids
    outs = llm.generate([free_prompt, chat_ids(llm, ASK), free_prompt], [free, person_params(seed=2), free])
    assert outs[0].outputs[0].token_ids == alone and outs[2].outputs[0].token_ids == alone
    assert_person(outs[1].outputs[0].text)


def test_prefix_cache_hit_gives_the_same_constrained_output(llm):
    prompt = chat_ids(llm, [{"role": "system", "content": "You answer in JSON. " * 12}, *ASK])
    params = person_params(temperature=0.0)
    first = llm.generate([prompt], params)[0]
    second = llm.generate([prompt], params)[0]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].text == first.outputs[0].text
    assert_person(second.outputs[0].text)


def test_a_preempted_constrained_sequence_still_validates():
    roomy = LLM("smollm2-135m-instruct", dtype="float32", kv_cache_memory=256 << 20)
    names = ["Ada", "Bo", "Cy", "Di", "Ed", "Flo"]
    prompts = [chat_ids(roomy, [{"role": "user", "content": f"Describe {name} as JSON."}]) for name in names]
    params = person_params(temperature=0.0, max_tokens=120)
    expected = [o.outputs[0].text for o in roomy.generate(prompts, params)]
    # Room for about two of these at once: the others wait or are preempted and recomputed.
    tight = LLM(
        "smollm2-135m-instruct",
        dtype="float32",
        kv_cache_memory=roomy.engine.runner.block_bytes * 24,
        enable_prefix_caching=False,
    )
    got = [o.outputs[0].text for o in tight.generate(prompts, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected  # a recompute does not feed the matcher again
    for text in got:
        assert_person(text)


def test_a_bad_spec_fails_before_the_request_is_queued(llm):
    with pytest.raises(StructuredOutputsError) as info:
        llm.generate(["x"], SamplingParams(structured_outputs=constrained(regex="[unclosed")))
    assert info.value.param == "structured_outputs.regex"
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "spec",
    [
        {"grammar": "root ::= root"},
        {"regex": "[^\\s\\S]"},
        {"json": json.dumps({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})},
    ],
)
def test_a_grammar_no_text_fits_is_refused_up_front(llm, spec):
    with pytest.raises(StructuredOutputsError, match="allows no output at all") as info:
        llm.generate(["x"], SamplingParams(structured_outputs=constrained(**spec)))
    assert info.value.param == f"structured_outputs.{next(iter(spec))}"
    assert not llm.engine.has_unfinished_requests()


def test_a_grammar_that_comes_to_a_dead_end_fails_its_request_alone_as_its_own_error(llm):
    # "x" fits, then nothing: not even the end of text. The request's error, not the engine's.
    engine = llm.engine
    prompt = llm.tokenizer.encode("Say x:")
    dead_end = constrained(grammar='root ::= "x" rest\nrest ::= rest')
    engine.add_request("dead", prompt, SamplingParams(max_tokens=8, structured_outputs=dead_end))
    engine.add_request("free", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] = accumulate(results.get(out.request_id), out)
    dead = results["dead"]
    assert dead.finished and dead.error_code == "invalid_structured_output"
    assert "allows no further token" in dead.error and dead.outputs[0].text == "x"
    assert results["free"].error is None and len(results["free"].outputs[0].token_ids) == 4


def test_a_token_the_grammar_refuses_fails_its_request_alone(llm, monkeypatch):
    # The sampler never picks a refused token (it would take NaN logits): force one, as such a bug would.
    engine = llm.engine
    real_sampler = engine.runner.sampler

    def forcing(logits, states):
        out = real_sampler(logits, states)
        for i, state in enumerate(states):
            if state.grammar is not None:
                out.token_ids[i] = 0  # <|endoftext|>: a special token, which no grammar allows
        return out

    monkeypatch.setattr(engine.runner, "sampler", forcing)
    prompt = llm.tokenizer.encode("Name a colour:")
    engine.add_request("forced", prompt, SamplingParams(max_tokens=8, structured_outputs=constrained(regex="[a-z]+")))
    engine.add_request("free", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] = accumulate(results.get(out.request_id), out)
    assert results["forced"].error and results["forced"].finished
    assert results["forced"].error_code is None  # the engine's fault, not the request's
    assert results["free"].error is None and len(results["free"].outputs[0].token_ids) == 4
