"""The tool-call parsers: whole text, text split at every position, and random splits (hypothesis)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelm.engine.outputs import ToolCallDelta, merge_tool_calls
from servelm.engine.tool_parsers import FORMATS, detect_format, get_format, resolve_format
from servelm.engine.tool_parsers.json_call import CallObjectScanner, NotACall


def parse(fmt: str, chunks: list[str]) -> tuple[str, list[tuple[str | None, str]], list[ToolCallDelta]]:
    """Feed ``chunks``, then finish: (content, [(name, arguments)], every delta in order)."""
    parser = get_format(fmt).parser()
    content, deltas = "", []
    for piece in [*(parser.feed(c) for c in chunks), parser.finish()]:
        content += piece.content
        deltas += piece.tool_calls
    calls: list[ToolCallDelta] = []
    merge_tool_calls(calls, deltas)
    return content, [(c.name, c.arguments) for c in calls], deltas


WEATHER = '{"city": "Paris", "unit": "celsius"}'
CASES = [
    # Hermes
    (
        "hermes",
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "hermes",
        f'Let me check.\n\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n',
        "Let me check.",
        [("get_weather", WEATHER)],
    ),
    (
        "hermes",
        (
            '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>\n{"name": "b", "arguments": '
            '{"x": [1, -2.5e3, true, null, {"y": "\\"}\\u00e9"}]}}\n</tool_call>'
        ),
        "",
        [("a", "{}"), ("b", '{"x": [1, -2.5e3, true, null, {"y": "\\"}\\u00e9"}]}')],
    ),
    ("hermes", '<tool_call>\n{"arguments": {"q": 1}, "name": "late"}\n</tool_call>', "", [("late", '{"q": 1}')]),
    ("hermes", '<tool_call>\n{"name": "noargs"}\n</tool_call>', "", [("noargs", "{}")]),
    ("hermes", '<tool_call>\n{"name": "s", "arguments": "{\\"a\\": 1}"}\n</tool_call>', "", [("s", '{"a": 1}')]),
    ("hermes", "Plain text, no calls.\n", "Plain text, no calls.\n", []),
    (
        "hermes",
        "Use <tool_call> like this: <tool_call> not JSON",
        "Use <tool_call> like this: <tool_call> not JSON",
        [],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
        [],
    ),
    ("hermes", '<tool_call>\n{"title": "x"}', '<tool_call>\n{"title": "x"}', []),
    ("hermes", "a <tool_ca", "a <tool_ca", []),
    ("hermes", "<tool_call>", "<tool_call>", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call> And then text.', "And then text.", [("f", "{}")]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "cut sh', "", [("f", '{"a": "cut sh')]),
    # Llama 3 JSON
    ("llama3_json", f' {{"name": "get_weather", "parameters": {WEATHER}}}', "", [("get_weather", WEATHER)]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {"n": 1}}; {"name": "b", "parameters": {}}',
        "",
        [("a", '{"n": 1}'), ("b", "{}")],
    ),
    ("llama3_json", 'I will call it. <|python_tag|>{"name": "a", "arguments": {}}', "I will call it.", [("a", "{}")]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ("llama3_json", "The answer is {x}.", "The answer is {x}.", []),
    ("llama3_json", '{"name": "a", "parameters": {}} and more', "and more", [("a", "{}")]),
    # Mistral
    (
        "mistral",
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name": "b", "arguments": {{}}}}]',
        "",
        [("get_weather", WEATHER), ("b", "{}")],
    ),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": [1]}, "id": "abcdefghi"}]', "", [("a", '{"x": [1]}')]),
    ("mistral", "No [TOOL_CALLS here", "No [TOOL_CALLS here", []),
    ("mistral", "[TOOL_CALLS] nothing", "[TOOL_CALLS] nothing", []),
]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_whole_text(fmt, text, content, calls):
    assert parse(fmt, [text])[:2] == (content, calls)


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_split_at_every_position(fmt, text, content, calls):
    for cut in range(len(text) + 1):
        assert parse(fmt, [text[:cut], text[cut:]])[:2] == (content, calls), cut


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_one_character_at_a_time_streams_the_call_in_openai_order(fmt, text, content, calls):
    got_content, got_calls, deltas = parse(fmt, list(text))
    assert (got_content, got_calls) == (content, calls)
    seen: set[int] = set()
    for d in deltas:
        if d.index not in seen:
            # The first piece of a call names it and has no arguments yet.
            assert d.name is not None and d.arguments == "", deltas
            assert d.index == len(seen)
            seen.add(d.index)
        else:
            assert d.name is None


@given(data=st.data())
@settings(max_examples=300, deadline=None)
def test_random_splits_give_the_whole_texts_result(data):
    fmt, text, content, calls = data.draw(st.sampled_from(CASES))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert parse(fmt, chunks)[:2] == (content, calls)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(max_size=6), json_values, max_size=4)
names = st.from_regex(r"[a-zA-Z0-9_-]{1,12}", fullmatch=True)


@given(
    fmt=st.sampled_from(sorted(FORMATS)),
    calls=st.lists(st.tuples(names, arguments), min_size=1, max_size=3),
    indent=st.sampled_from([None, 2]),
    cuts=st.lists(st.integers(0, 10_000), max_size=6),
)
@settings(max_examples=300, deadline=None)
def test_any_calls_the_format_writes_parse_back(fmt, calls, indent, cuts):
    written = [(name, json.dumps(args, indent=indent)) for name, args in calls]
    text = get_format(fmt).calls_text(written)
    cuts = sorted(c % (len(text) + 1) for c in cuts)
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    content, got, deltas = parse(fmt, chunks)
    assert content == ""
    assert got == written
    # Arguments stream as they are written: every prefix sent so far is a prefix of the whole.
    sent: dict[int, str] = {}
    for d in deltas:
        sent[d.index] = sent.get(d.index, "") + d.arguments
        assert written[d.index][1].startswith(sent[d.index])


@given(fmt=st.sampled_from(sorted(FORMATS)), text=st.text(), cuts=st.lists(st.integers(0, 10_000), max_size=6))
@settings(max_examples=300, deadline=None)
def test_text_without_calls_is_content_unchanged(fmt, text, cuts):
    markers = get_format(fmt).syntax.markers
    if any(m in text for m in markers) or text.lstrip().startswith("{"):
        return
    cuts = sorted(c % (len(text) + 1) for c in cuts)
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert parse(fmt, chunks)[:2] == (text, [])


@given(fmt=st.sampled_from(sorted(FORMATS)), text=st.text(alphabet='{}[]":,; \n<>/_abcnmetrulsTOLC|0-9.', max_size=40))
@settings(max_examples=500, deadline=None)
def test_any_text_parses_without_raising_and_loses_no_content_when_no_call(fmt, text):
    content, calls, _ = parse(fmt, list(text))
    if not calls:
        assert content.strip() == text.strip()


def test_scanner_rejects_bad_json_and_foreign_keys():
    for bad in [
        '{"name" "x"}',
        '{"name": "x",}',
        '{"name": tru}',
        '{"name": "x", "arguments": {"a": 01}}',
        '{"other": 1}',
        "[1]",
        '{"name": "a\x01"}',
    ]:
        scanner = CallObjectScanner()
        with pytest.raises(NotACall):
            for ch in bad:
                scanner.feed(ch)


def test_scanner_reads_name_and_arguments_span():
    scanner = CallObjectScanner()
    text = '{"name": "f\\u00e9", "arguments": {"a": [1, {"b": null}]}, "id": "x"}'
    for ch in text:
        scanner.feed(ch)
    assert scanner.done and scanner.name == "fé"
    assert scanner.arguments == '{"a": [1, {"b": null}]}'


@pytest.mark.parametrize(
    "template,expected",
    [
        (None, "hermes"),
        ("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}", "hermes"),
        ("<|start_header_id|>{{ role }}<|end_header_id|>", "llama3_json"),
        ("{{- '<|python_tag|>' + call }}", "llama3_json"),
        ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]", "mistral"),
    ],
)
def test_format_detected_from_the_chat_template(template, expected):
    assert detect_format(template) == expected
    assert resolve_format("auto", template) == expected
    assert resolve_format("mistral", template) == "mistral"


def test_unknown_format_names_the_known_ones():
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_format("nope")
