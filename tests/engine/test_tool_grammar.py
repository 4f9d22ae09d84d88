"""The structural tags that force tool calls, checked with xgrammar itself on the bundled model's vocabulary.

A forced reply (tool_choice "required" or a named function) must be calls
in the model's format whose arguments validate against the function's
parameters: the grammar accepts exactly that, and what it accepts the
parser reads back as the same calls.
"""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from servelm.engine.outputs import ToolCallDelta, merge_tool_calls
from servelm.engine.tool_parsers import FORMATS, get_format
from servelm.engine.tool_parsers.format import MAX_WHITESPACE

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
}
NO_PARAMS = {"type": "object", "properties": {}}
FUNCTIONS = [("get_weather", WEATHER), ("get_time", NO_PARAMS)]


@pytest.fixture(scope="module")
def compiler(model_path):
    from servelm.models.tokenizer import load_tokenizer

    tok = load_tokenizer(model_path)
    info = xgr.TokenizerInfo.from_huggingface(tok.hf, stop_token_ids=sorted(tok.eos_token_ids))
    return xgr.GrammarCompiler(info), min(tok.eos_token_ids)


def accepts(compiler, tag: dict, text: str) -> bool:
    """True when the grammar takes ``text`` and then lets the reply end."""
    compiled, eos = compiler
    matcher = xgr.GrammarMatcher(compiled.compile_structural_tag(json.dumps(tag)))
    return matcher.accept_string(text) and matcher.accept_token(eos)


def parsed_calls(fmt: str, text: str) -> list[tuple[str | None, str]]:
    parser = get_format(fmt).parser()
    calls: list[ToolCallDelta] = []
    for piece in (parser.feed(text), parser.finish()):
        assert piece.content == ""
        merge_tool_calls(calls, piece.tool_calls)
    return [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_required_accepts_valid_calls_and_the_parser_reads_them(compiler, fmt):
    f = get_format(fmt)
    tag = f.structural_tag(FUNCTIONS, one_call=False)
    for calls in (
        [("get_weather", '{"city": "Paris", "days": 3}')],
        [("get_time", "{}")],
        [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")],
        [("get_weather", '{\n  "city": "Rome"\n}')],
        [("get_weather", '{"city":' + " " * MAX_WHITESPACE + '"Rome"}')],
    ):
        text = f.calls_text(calls)
        assert accepts(compiler, tag, text), text
        assert parsed_calls(fmt, text) == calls


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize(
    "text",
    [
        "Sure! Let me look that up.",
        "",
        '{"city": "Paris"}',
    ],
)
def test_required_rejects_prose_and_bare_json(compiler, fmt, text):
    assert not accepts(compiler, get_format(fmt).structural_tag(FUNCTIONS, one_call=False), text)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize(
    "name,arguments",
    [
        ("get_weather", '{"days": 3}'),  # a required property missing
        ("get_weather", '{"city": 3}'),  # the wrong type
        ("get_weather", '{"city": "Paris", "days": 0}'),  # below the minimum
        ("get_weather", '{"city": "Paris", "color": "red"}'),  # a property the schema does not have
        ("unknown_function", "{}"),
        ("get_weather", '{"city":' + " " * (MAX_WHITESPACE + 1) + '"Paris"}'),  # runaway padding
    ],
)
def test_required_rejects_arguments_outside_the_schema(compiler, fmt, name, arguments):
    f = get_format(fmt)
    assert not accepts(compiler, f.structural_tag(FUNCTIONS, one_call=False), f.calls_text([(name, arguments)]))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_one_call_allows_exactly_one(compiler, fmt):
    f = get_format(fmt)
    tag = f.structural_tag([FUNCTIONS[0]], one_call=True)
    assert accepts(compiler, tag, f.calls_text([("get_weather", '{"city": "Paris"}')]))
    assert not accepts(compiler, tag, f.calls_text([("get_weather", '{"city": "Paris"}')] * 2))
    assert not accepts(compiler, tag, f.calls_text([("get_time", "{}")]))  # only the named function


def test_after_a_hermes_call_only_the_end_or_another_call_may_follow(compiler):
    # A newline there is what a small model continues with, into the same call again and again.
    f = get_format("hermes")
    compiled, _ = compiler
    grammar = compiled.compile_structural_tag(json.dumps(f.structural_tag(FUNCTIONS, one_call=False)))
    call = f.calls_text([("get_time", "{}")])
    for after, ok in (("\n", False), (" ", False), ("<tool_call>", True)):
        matcher = xgr.GrammarMatcher(grammar)
        assert matcher.accept_string(call)
        assert matcher.accept_string(after) is ok, after
