"""The offline API with tools, on the bundled model: the template offers them and the engine parses replies."""

from __future__ import annotations

import json

import pytest

from servelm import SamplingParams

pytestmark = pytest.mark.model

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def test_chat_with_tools_offers_them_and_parses_the_reply(llm):
    params = SamplingParams(temperature=0, max_tokens=8)
    (out,) = llm.chat([{"role": "user", "content": "Weather in Paris?"}], params, tools=[WEATHER])
    prompt = llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
    assert json.dumps(WEATHER) in prompt and "<tool_call>" in prompt
    # Prose stays content; the reply was read by the Hermes parser (the template implies it).
    assert out.outputs[0].tool_calls == [] and out.outputs[0].text
    assert params.tool_call_parser is None  # the caller's params are not changed


def test_a_parsed_reply_splits_into_content_and_calls(llm):
    # The model copies the call it is shown: what it writes is read as a call, token by token.
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    prompt = f"Copy this line exactly.\n{call}\n{call}\n{call}\n"
    (greedy,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop=["</tool_call>"]))
    assert greedy.outputs[0].text == call.removesuffix("</tool_call>")
    (parsed,) = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=40, stop=["</tool_call>"], tool_call_parser="hermes")
    )
    out = parsed.outputs[0]
    assert out.token_ids == greedy.outputs[0].token_ids and out.text == ""
    assert [(c.index, c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        (0, "get_weather", {"city": "Paris"})
    ]
