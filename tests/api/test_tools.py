"""Tool calling through POST /v1/chat/completions against the fake connector.

The fake runs each choice's text through the real (pure) tool-call parser,
as the engine's output processor does, so these tests pin OpenAI's shapes:
the reply's ``tool_calls``, the stream's pieces, ``finish_reason`` and the
400s for tool fields OpenAI would refuse.
"""

from __future__ import annotations

import json

import pytest

from servelm.engine.tool_parsers import get_format

from .conftest import make_app, make_client
from .fake_connector import CHAT_MODEL
from .test_chat import chat, chunks

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = CALL_TEXT + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
# Deep enough for the schema check to recurse past Python's limit, not for the JSON parser.
DEEP_SCHEMA = json.loads('{"type": "object", "properties": {"a": ' * 150 + "{}" + "}}" * 150)


def assemble(events: list[dict]) -> dict[int, dict]:
    """Fold a chat stream into each choice's content, tool calls and finish_reason, as the openai SDK does."""
    choices: dict[int, dict] = {}
    for event in events:
        for c in event["choices"]:
            choice = choices.setdefault(c["index"], {"content": None, "tool_calls": {}, "finish_reason": None})
            delta = c["delta"]
            if delta.get("content") is not None:
                choice["content"] = (choice["content"] or "") + delta["content"]
            for piece in delta.get("tool_calls", []):
                call = choice["tool_calls"].setdefault(piece["index"], {"id": None, "name": None, "arguments": ""})
                if "id" in piece:
                    call["id"], call["name"] = piece["id"], piece["function"]["name"]
                call["arguments"] += piece["function"].get("arguments", "")
            if c.get("finish_reason"):
                choice["finish_reason"] = c["finish_reason"]
    return choices


async def test_auto_reply_with_a_call(client, fake):
    fake.reply_text = CALL_TEXT
    r = await chat(client, tools=[WEATHER])
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice == {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "annotations": [],
            "tool_calls": [
                {
                    "id": "call_test",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
            ],
        },
        "logprobs": None,
        "finish_reason": "tool_calls",
    }
    params = fake.generate_calls[0][3]
    assert params.tool_call_parser == "hermes" and params.skip_special_tokens is True
    template = fake.template_calls[0]
    assert template["tools"] == [WEATHER] and template["tool_call_parser"] == "hermes"


async def test_text_before_the_calls_is_the_content(client, fake):
    fake.reply_text = "Let me check both.\n" + TWO_CALLS
    r = await chat(client, tools=[WEATHER, TIME])
    message = r.json()["choices"][0]["message"]
    assert message["content"] == "Let me check both."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", "{}"),
    ]


async def test_a_reply_without_calls_is_plain_text(client, fake):
    fake.reply_text = "It is sunny."
    r = await chat(client, tools=[WEATHER])
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny.", "refusal": None, "annotations": []}
    assert choice["finish_reason"] == "stop"


async def test_streamed_calls_arrive_as_openai_streams_them_and_assemble_to_the_reply(client, fake):
    fake.reply_text = "Checking.\n" + TWO_CALLS
    body = {"tools": [WEATHER, TIME], "n": 2}
    whole = (await chat(client, **body)).json()
    events = chunks((await chat(client, stream=True, stream_options={"include_usage": True}, **body)).text)
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    # Per choice: the role first, then content, then each call named (id, type, name, empty
    # arguments) before its arguments arrive in pieces; the last chunk's finish_reason is tool_calls.
    for index in (0, 1):
        deltas = [c["delta"] for e in events for c in e["choices"] if c["index"] == index]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert deltas[-1] == {}
        pieces = [p for d in deltas for p in d.get("tool_calls", [])]
        assert pieces[0] == {
            "index": 0,
            "id": "call_test",
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        }
        assert all(
            set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in pieces if "id" not in p
        )
        assert len([p for p in pieces if p["index"] == 0]) > 2  # the arguments stream in several pieces
        finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["index"] == index]
        assert finishes[-1] == "tool_calls" and not any(finishes[:-1])
    streamed = assemble(events)
    for choice in whole["choices"]:
        got = streamed[choice["index"]]
        assert got["content"] == choice["message"]["content"]
        assert got["finish_reason"] == choice["finish_reason"] == "tool_calls"
        assert [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in got["tool_calls"].values()
        ] == choice["message"]["tool_calls"]


async def test_tool_choice_none_offers_the_tools_but_never_parses(client, fake):
    fake.reply_text = CALL_TEXT
    r = await chat(client, tools=[WEATHER], tool_choice="none")
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == CALL_TEXT and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    assert fake.generate_calls[0][3].tool_call_parser is None
    assert fake.template_calls[0]["tools"] == [WEATHER]


def forcing_grammar(fake) -> dict:
    """The structural tag the request's params force its reply with."""
    structured = fake.generate_calls[-1][3].structured_outputs
    assert structured is not None and structured.kind == "structural_tag"
    return json.loads(structured.structural_tag)


async def test_a_named_function_is_forced_and_ends_with_stop_as_openai_does(client, fake):
    fake.reply_text = CALL_TEXT
    r = await chat(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.json()["choices"][0]
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert choice["finish_reason"] == "stop"
    # One call of that function only (the grammar itself is tested with xgrammar in tests/engine).
    assert forcing_grammar(fake) == get_format("hermes").structural_tag(
        [("get_weather", WEATHER["function"]["parameters"])], one_call=True
    )


async def test_required_is_forced_and_ends_with_tool_calls(client, fake):
    fake.reply_text = CALL_TEXT
    r = await chat(client, tools=[WEATHER, TIME], tool_choice="required")
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    no_parameters = {"type": "object", "properties": {}}
    functions = [("get_weather", WEATHER["function"]["parameters"]), ("get_time", no_parameters)]
    assert forcing_grammar(fake) == get_format("hermes").structural_tag(functions, one_call=False)
    await chat(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert forcing_grammar(fake) == get_format("hermes").structural_tag(functions, one_call=True)
    events = chunks((await chat(client, tools=[WEATHER], tool_choice="required", stream=True)).text)
    # A reply forced to be calls opens without content.
    assert events[0]["choices"][0]["delta"] == {"role": "assistant"}


async def test_auto_and_none_are_not_forced(client, fake):
    for choice in ("auto", "none"):
        await chat(client, tools=[WEATHER], tool_choice=choice)
        assert fake.generate_calls[-1][3].structured_outputs is None


async def test_a_grammar_the_engine_cannot_compile_names_tools(fake):
    from servelm.connectors.base import ConnectorError

    fake.raise_on_start = ConnectorError(
        "structured_outputs.structural_tag is not a valid structural tag",
        param="structured_outputs.structural_tag",
        code="invalid_structured_output",
    )
    async with make_client(make_app(fake)) as client:
        r = await chat(client, tools=[WEATHER], tool_choice="required")
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "tools is not a valid structural tag",
        "type": "invalid_request_error",
        "param": "tools",
        "code": "invalid_structured_output",
    }


async def test_parallel_tool_calls_false_keeps_the_first_call(client, fake):
    fake.reply_text = TWO_CALLS
    r = await chat(client, tools=[WEATHER, TIME], parallel_tool_calls=False)
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    events = chunks((await chat(client, tools=[WEATHER, TIME], parallel_tool_calls=False, stream=True)).text)
    assert {p["index"] for e in events for c in e["choices"] for p in c["delta"].get("tool_calls", [])} == {0}


async def test_a_call_cut_by_max_tokens_ends_with_length(client, fake):
    fake.reply_text = CALL_TEXT
    r = await chat(client, tools=[WEATHER], max_tokens=len(CALL_TEXT) - 20)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "P'


async def test_the_setting_picks_the_format(fake):
    fake.reply_text = get_format("mistral").calls_text([("get_weather", '{"city": "Oslo"}')])
    async with make_client(make_app(fake, tool_call_parser="mistral")) as client:
        r = await chat(client, tools=[WEATHER])
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    params = fake.generate_calls[0][3]
    # [TOOL_CALLS] is a special token of Mistral's tokenizers: the text must keep it.
    assert params.tool_call_parser == "mistral" and params.skip_special_tokens is False
    assert fake.template_calls[0]["tool_call_parser"] == "mistral"


async def test_a_chat_template_override_implies_its_format(fake, tmp_path):
    template = tmp_path / "llama.jinja"
    template.write_text("<|start_header_id|>{{ messages[0].content }}")
    fake.reply_text = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    async with make_client(make_app(fake, chat_template=str(template))) as client:
        r = await chat(client, tools=[WEATHER])
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert fake.generate_calls[0][3].tool_call_parser == "llama3_json"


async def test_a_tool_result_round_trips_to_the_template(client, fake):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Weather?"},
        # The reply's message sent back as it came, with its refusal and annotations.
        {"role": "assistant", "content": None, "refusal": None, "annotations": [], "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "21 C"}]},
    ]
    r = await chat(client, messages=messages, tools=[WEATHER])
    assert r.status_code == 200, r.text
    assert fake.template_calls[0]["messages"][1:] == [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "21 C", "tool_call_id": "call_1"},
    ]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required", "tools": []}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "tool_choice"),
        ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "banana"}}}]},
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"minimum": "zero"}}},
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP_SCHEMA}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [TIME], "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        (
            {
                "tools": [
                    TIME,
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
                        },
                    },
                ],
                "tool_choice": "required",
            },
            "tools[1].function.parameters",
        ),
        ({"messages": [{"role": "tool", "content": "21 C"}]}, "messages[0].tool_call_id"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            },
            "messages[0].tool_calls",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {}}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
async def test_bad_tool_fields_are_400_naming_the_field(client, fake, body, param):
    r = await chat(client, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert not fake.generate_calls


async def test_tool_choice_none_without_tools_is_accepted(client):
    assert (await chat(client, tool_choice="none")).status_code == 200


async def test_the_openai_client_reads_the_calls(live_server, fake):
    from openai import AsyncOpenAI

    fake.reply_text = CALL_TEXT
    client = AsyncOpenAI(base_url=f"{live_server}/v1", api_key="unused")
    reply = await client.chat.completions.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": "x"}], tools=[WEATHER]
    )
    call = reply.choices[0].message.tool_calls[0]
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "call_test",
        "get_weather",
        {"city": "Paris"},
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    async with client.chat.completions.stream(
        model=CHAT_MODEL, messages=[{"role": "user", "content": "x"}], tools=[WEATHER]
    ) as stream:
        final = await stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    await client.close()


async def test_tokenize_renders_tools_as_chat_does(client, fake):
    messages = [{"role": "user", "content": "x"}]
    r = await client.post("/tokenize", json={"model": CHAT_MODEL, "messages": messages, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    await chat(client, messages=messages, tools=[WEATHER])
    assert fake.template_calls[0] == fake.template_calls[1]
    assert fake.template_calls[0]["tools"] == [WEATHER] and fake.template_calls[0]["tool_call_parser"] == "hermes"
    bad = await client.post(
        "/tokenize", json={"messages": messages, "tools": [{"type": "function", "function": {"name": "a b"}}]}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[0].function.name"
