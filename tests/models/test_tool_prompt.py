"""Chat templates and tools: definitions, past calls and their results reach the prompt.

The bundled SmolLM2's ChatML template knows nothing of tools, so servelm
teaches them in the Hermes format; a template that reads ``tools`` renders
them itself and gets arguments as objects, as transformers passes them.
"""

from __future__ import annotations

import json

import pytest

from servelm.engine.tool_parsers import get_format
from servelm.models.tool_prompt import template_reads_tools, tool_messages

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {
    "id": "call_abc123XYZ789",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            CALL,
            {**CALL, "id": "call_2", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_abc123XYZ789", "content": "21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "25 C"},
]

# A template in the shape of Qwen 2.5's: it reads tools, tool_calls and tool messages itself.
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }} city={{ c.function.arguments.city }}\n{% endfor %}"
    "{% elif m.role == 'tool' %}RESULT {{ m.tool_call_id }}: {{ m.content }}\n"
    "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from servelm.models.tokenizer import load_tokenizer

    return load_tokenizer(model_path)


def test_chatml_template_is_taught_the_tools_in_the_system_message(tokenizer):
    assert not template_reads_tools(tokenizer.chat_template)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL])
    system, user = text.split("<|im_start|>user\n")
    assert system.startswith("<|im_start|>system\n# Tools")
    assert json.dumps(WEATHER_TOOL) in system
    assert '<tool_call>\n{"name": "<function-name>", "arguments": <arguments-json-object>}\n</tool_call>' in system
    assert "SmolLM" not in system  # the tools block replaces the template's default system prompt
    assert user == "Weather in Paris?<|im_end|>\n<|im_start|>assistant\n"


def test_a_system_message_keeps_its_text_and_gains_the_tools(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], tools=[WEATHER_TOOL]
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert text.count("<|im_start|>system") == 1


def test_chatml_template_renders_past_calls_and_results_in_the_hermes_format(tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATION, tools=[WEATHER_TOOL])
    calls = get_format("hermes").calls_text([("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')])
    assert f"<|im_start|>assistant\n{calls}<|im_end|>\n" in text
    # Both results of the turn in one user message, as Hermes models were trained.
    assert (
        "<|im_start|>user\n<tool_response>\n21 C\n</tool_response>\n<tool_response>\n25 C\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    ) in text
    assert "<|im_start|>tool" not in text


def test_past_calls_render_even_without_tools_in_the_request(tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATION)
    assert "# Tools" not in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text


def test_assistant_text_before_its_calls_is_kept(tokenizer):
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert "<|im_start|>assistant\nChecking.\n<tool_call>\n" in text


def test_a_template_that_reads_tools_renders_them_itself_with_arguments_as_objects(tokenizer):
    assert template_reads_tools(TOOL_TEMPLATE)
    text = tokenizer.apply_chat_template(
        CONVERSATION, chat_template=TOOL_TEMPLATE, tools=[WEATHER_TOOL], add_generation_prompt=False
    )
    assert text == (
        "TOOLS:get_weather;\n"
        "user: Weather in Paris and Rome?\n"
        'CALL call_abc123XYZ789 get_weather {"city": "Paris"} city=Paris\n'
        'CALL call_2 get_weather {"city": "Rome"} city=Rome\n'
        "RESULT call_abc123XYZ789: 21 C\n"
        "RESULT call_2: 25 C\n"
    )


def test_mistral_templates_get_nine_character_call_ids(tokenizer):
    text = tokenizer.apply_chat_template(
        CONVERSATION[:3],
        chat_template=TOOL_TEMPLATE,
        tools=[WEATHER_TOOL],
        tool_call_parser="mistral",
        add_generation_prompt=False,
    )
    # Nine characters: the id's last letters and digits, padded with zeros.
    assert "CALL 123XYZ789 get_weather" in text
    assert "RESULT 123XYZ789: 21 C" in text
    assert "CALL 0000call2 get_weather" in text


def test_arguments_that_are_not_json_reach_the_template_as_text():
    call = {**CALL, "function": {"name": "f", "arguments": "not json"}}
    messages, extra = tool_messages(
        [{"role": "assistant", "content": "", "tool_calls": [call]}],
        None,
        get_format("hermes"),
        template_knows_tools=True,
    )
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == "not json"
    assert extra == {}


def test_the_format_comes_from_the_setting_when_given(tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATION[:2], tools=[WEATHER_TOOL], tool_call_parser="llama3_json")
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_weather", "parameters"' in text


@pytest.mark.parametrize(
    "template,reads",
    [
        ("{{ messages }}", False),
        ("{% for t in tools %}{{ t }}{% endfor %}", True),
        ("{% set tools = [] %}{{ tools }}", False),  # assigned, not read from the caller
        ("{% generation %}{{ tools }}{% endgeneration %}", True),  # a tag only transformers knows: a plain look
    ],
)
def test_template_reads_tools(template, reads):
    assert template_reads_tools(template) is reads
