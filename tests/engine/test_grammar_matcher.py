"""Grammars on a tiny in-memory tokenizer: compiling each kind, the per-sequence matcher, the batch bitmask.

No model: xgrammar compiles against :mod:`tests.engine.tiny_tokenizer`, a
byte-level vocabulary with special tokens and padding past its end.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelm.engine.grammar_compiler import GrammarCompiler, clean_error
from servelm.engine.grammar_matcher import GrammarMatcher, mask_logits
from servelm.engine.structured_outputs import StructuredOutputsError, StructuredOutputsParams

from .tiny_tokenizer import EOS, tiny_tokenizer

VOCAB = 270  # the model's logits are wider than the tokenizer's 263 entries, as with padded vocabularies


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(tiny_tokenizer(), VOCAB, {EOS})


@pytest.fixture(scope="module")
def hf(compiler):
    return compiler._tokenizer.hf


def allowed(matcher: GrammarMatcher) -> set[int]:
    logits = torch.zeros(1, VOCAB)
    masked = mask_logits(logits, [matcher])
    return set(torch.nonzero(masked[0] > float("-inf"))[:, 0].tolist())


def matcher(compiler, **spec) -> GrammarMatcher:
    return GrammarMatcher(compiler.compile(StructuredOutputsParams(**spec)), {EOS})


def feed(m: GrammarMatcher, hf, text: str) -> bool:
    return all(m.accept(t) for t in hf.encode(text, add_special_tokens=False))


def test_special_and_padding_tokens_are_never_allowed_and_eos_only_at_the_end(compiler, hf):
    m = matcher(compiler, regex="[a-z ]{1,12}")
    first = allowed(m)
    assert not first & {0, 1, EOS} and not first & set(range(263, VOCAB))
    assert hf.convert_tokens_to_ids("a") in first and hf.convert_tokens_to_ids("ab") in first
    assert feed(m, hf, "ab")
    assert EOS in allowed(m)  # the regex may end here
    assert feed(m, hf, "cdefghijkl")
    assert allowed(m) == {EOS}  # twelve characters: it must end
    assert not m.is_terminated
    assert m.accept(EOS) and m.is_terminated


def test_a_refused_token_changes_nothing(compiler, hf):
    m = matcher(compiler, regex="[0-9]+")
    before = allowed(m)
    assert not m.accept(hf.convert_tokens_to_ids("a"))
    assert m.num_accepted == 0 and allowed(m) == before


def test_rollback_returns_to_an_earlier_state(compiler, hf):
    m = matcher(compiler, json={"type": "object", "properties": {"ab": {"type": "integer"}}, "required": ["ab"]})
    start = allowed(m)
    assert feed(m, hf, '{"ab": 1')
    after = allowed(m)
    count = m.num_accepted
    assert feed(m, hf, "2")
    m.rollback(1)
    assert m.num_accepted == count and allowed(m) == after
    m.rollback(count)
    assert allowed(m) == start
    with pytest.raises(ValueError):
        m.rollback(1)


def test_json_schema_output_is_compact_and_complete(compiler, hf):
    schema = {
        "type": "object",
        "properties": {"ab": {"type": "integer"}, "b": {"type": "string"}},
        "required": ["ab", "b"],
    }
    m = matcher(compiler, json=schema)
    assert not feed(matcher(compiler, json=schema), hf, '{ "ab"')  # no free whitespace
    assert feed(m, hf, '{"ab": 12, "b": "x"}')
    assert allowed(m) == {EOS}


def test_json_object_allows_any_object_and_only_objects(compiler, hf):
    assert feed(matcher(compiler, json_object=True), hf, '{"x": [1, {"y": null}], "z": "w"}')
    assert not feed(matcher(compiler, json_object=True), hf, "[1]")


@pytest.mark.parametrize("choices", [["yes", "no"], ['say "hi"', "back\\slash", "two\nlines", "naïve ☃"]])
def test_choice_matches_exactly_one_choice(compiler, hf, choices):
    for choice in choices:
        m = matcher(compiler, choice=choices)
        assert feed(m, hf, choice) and EOS in allowed(m), choice
    assert not feed(matcher(compiler, choice=choices), hf, choices[0] + "!")


def test_ebnf_grammar(compiler, hf):
    m = matcher(compiler, grammar='root ::= "a" digits\ndigits ::= [0-9]+')
    assert feed(m, hf, "a42") and EOS in allowed(m)
    assert not feed(matcher(compiler, grammar='root ::= "a" [0-9]+'), hf, "b")


def test_structural_tag_is_free_text_until_its_trigger(compiler, hf):
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<f>"],
            "tags": [
                {"begin": "<f>", "content": {"type": "json_schema", "json_schema": {"type": "integer"}}, "end": "</f>"}
            ],
        },
    }
    m = matcher(compiler, structural_tag=json.dumps(tag))
    assert feed(m, hf, "any text <f>12</f>")
    assert not feed(matcher(compiler, structural_tag=json.dumps(tag)), hf, "<f>x")


@pytest.mark.parametrize(
    "spec, param, words",
    [
        ({"regex": "(ab"}, "structured_outputs.regex", "parenthesis"),
        ({"grammar": "root ::= missing"}, "structured_outputs.grammar", "missing"),
        ({"grammar": 'rot ::= "a"'}, "structured_outputs.grammar", "root"),
        ({"json": {"type": "frobnicate"}}, "structured_outputs.json", "frobnicate"),
        ({"json": {"$ref": "#/$defs/nowhere"}}, "structured_outputs.json", "nowhere"),
        ({"json": {"type": "array", "items": 5}}, "structured_outputs.json", "items"),
        ({"structural_tag": "{}"}, "structured_outputs.structural_tag", "format"),
    ],
)
def test_compile_errors_name_the_kind_and_say_why(compiler, spec, param, words):
    with pytest.raises(StructuredOutputsError) as info:
        compiler.compile(StructuredOutputsParams(**spec))
    err = info.value
    assert err.param == param and err.code == "invalid_structured_output"
    message = str(err)
    assert message.startswith(param) and words in message
    assert ".cc:" not in message and "Check failed" not in message and "\n" not in message


def test_a_grammar_compiles_once_and_later_requests_hit_the_cache(hf):
    compiler = GrammarCompiler(tiny_tokenizer(), VOCAB, {EOS})
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"ab": {"type": "integer"}}})
    assert compiler.cached(spec) is None
    first = compiler.compile(spec)
    same = StructuredOutputsParams(
        json=json.dumps({"type": "object", "properties": {"ab": {"type": "integer"}}}, separators=(",", ":"))
    )
    assert compiler.cached(spec) is first and compiler.compile(same) is first
    assert compiler.stats.compiles == 1 and compiler.stats.hits == 2
    compiler.compile(StructuredOutputsParams(regex="a+"))
    assert compiler.stats.compiles == 2 and compiler.stats.compile_seconds > 0


def test_a_failed_compile_is_not_cached(compiler):
    for _ in range(2):
        with pytest.raises(StructuredOutputsError):
            compiler.compile(StructuredOutputsParams(regex="[a-"))


def test_mask_logits_touches_only_constrained_rows(compiler, hf):
    logits = torch.randn(4, VOCAB)
    assert mask_logits(logits, [None] * 4) is logits
    m = matcher(compiler, choice=["ab"])
    masked = mask_logits(logits, [None, m, None, m])
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    ab = hf.convert_tokens_to_ids("ab")
    for row in (1, 3):
        finite = torch.nonzero(masked[row] > float("-inf"))[:, 0].tolist()
        assert ab in finite and hf.convert_tokens_to_ids("b") not in finite
        assert torch.equal(masked[row][finite], logits[row][finite])
    assert torch.isfinite(logits).all()  # the raw logits are left as they were (logprobs read them)


def test_clean_error_keeps_the_message_only():
    exc = RuntimeError("[14:47:41] /project/cpp/regex_converter.cc:83: Regex parsing error at position 5: bad.\n")
    assert clean_error(exc) == "Regex parsing error at position 5: bad."
    check = RuntimeError("[14:47:41] /x/json_schema_converter.cc:4939: Check failed: (error.empty()) is false: Oops")
    assert clean_error(check) == "Oops"


REGEX = "(ab|a)*c?[0-9]{0,2}"


@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=st.text(alphabet="abc01", max_size=8))
def test_the_matcher_agrees_with_python_s_regex_engine(compiler, hf, text):
    # A text is a full match exactly when the matcher takes all of its tokens and then allows EOS.
    m = matcher(compiler, regex=REGEX)
    full = feed(m, hf, text) and EOS in allowed(m)
    assert full == bool(re.fullmatch(REGEX, text))
