"""POST /v1/chat/completions against the fake connector."""

from __future__ import annotations

import hashlib
import json

import pytest

from servelm.api.serving_base import servelm_version
from servelm.connectors.base import ContextLengthExceeded

from .conftest import make_app, make_client
from .fake_connector import CHAT_MODEL, encode

USER = [{"role": "user", "content": "x"}]
PROMPT_TOKENS = len(encode("<|user|>x\n<|assistant|>", add_special_tokens=False))
# OpenAI's usage always breaks the completion tokens down; servelm has none of these kinds.
NO_COMPLETION_DETAILS = {
    "reasoning_tokens": 0,
    "audio_tokens": 0,
    "accepted_prediction_tokens": 0,
    "rejected_prediction_tokens": 0,
}


def fingerprint() -> str:
    digest = hashlib.sha1(f"{servelm_version()}:fake-chat:/models/fake-chat.gguf".encode()).hexdigest()
    return f"fp_{digest[:10]}"


def events(text: str) -> list[str]:
    """The SSE events of a body, checking the framing on the way."""
    assert text.endswith("\n\n")
    parts = text[:-2].split("\n\n")
    assert all(p.startswith("data: ") for p in parts)
    return [p[len("data: ") :] for p in parts]


def chunks(text: str) -> list[dict]:
    evs = events(text)
    assert evs[-1] == "[DONE]"
    return [json.loads(e) for e in evs[:-1]]


async def chat(client, **body):
    body.setdefault("model", CHAT_MODEL)
    body.setdefault("messages", USER)
    return await client.post("/v1/chat/completions", json=body)


async def test_non_streaming_response_shape(client, fake):
    r = await chat(client)
    assert r.status_code == 200
    assert r.json() == {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "fake-chat",
        "system_fingerprint": fingerprint(),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello world", "refusal": None, "annotations": []},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": 11,
            "total_tokens": PROMPT_TOKENS + 11,
            "prompt_tokens_details": {"cached_tokens": 2},
            "completion_tokens_details": NO_COMPLETION_DETAILS,
        },
    }
    # Chat passes token ids rendered by the template, without extra special tokens.
    model, request_id, prompt, params = fake.generate_calls[0]
    assert (model, request_id) == ("fake-chat", "chatcmpl-test")
    assert prompt == encode("<|user|>x\n<|assistant|>", add_special_tokens=False)
    assert params.max_tokens is None  # up to the context


async def test_stream_is_byte_exact(client, fake):
    fake.reply_text = "Hi"
    r = await chat(client, stream=True)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    fp = fingerprint()
    head = f'{{"id":"chatcmpl-test","object":"chat.completion.chunk","created":1700000000,"model":"fake-chat","system_fingerprint":"{fp}",'
    expected = (
        f'data: {head}"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}]}}\n\n'
        f'data: {head}"choices":[{{"index":0,"delta":{{"content":"H"}},"logprobs":null,"finish_reason":null}}]}}\n\n'
        f'data: {head}"choices":[{{"index":0,"delta":{{"content":"i"}},"logprobs":null,"finish_reason":null}}]}}\n\n'
        f'data: {head}"choices":[{{"index":0,"delta":{{}},"logprobs":null,"finish_reason":"stop"}}]}}\n\n'
        "data: [DONE]\n\n"
    )
    assert r.text == expected


async def test_stream_include_usage_is_byte_exact(client, fake):
    fake.reply_text = "Hi"
    r = await chat(client, stream=True, max_tokens=1, stream_options={"include_usage": True})
    fp = fingerprint()
    head = f'{{"id":"chatcmpl-test","object":"chat.completion.chunk","created":1700000000,"model":"fake-chat","system_fingerprint":"{fp}",'
    usage = f'{{"prompt_tokens":{PROMPT_TOKENS},"completion_tokens":1,"total_tokens":{PROMPT_TOKENS + 1},"prompt_tokens_details":{{"cached_tokens":2}},"completion_tokens_details":{{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}}'
    expected = (
        f'data: {head}"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}],"usage":null}}\n\n'
        f'data: {head}"choices":[{{"index":0,"delta":{{"content":"H"}},"logprobs":null,"finish_reason":null}}],"usage":null}}\n\n'
        f'data: {head}"choices":[{{"index":0,"delta":{{}},"logprobs":null,"finish_reason":"length"}}],"usage":null}}\n\n'
        f'data: {head}"choices":[],"usage":{usage}}}\n\n'
        "data: [DONE]\n\n"
    )
    assert r.text == expected


async def test_stream_n2_interleaves_by_choice_index(client, fake):
    fake.reply_text = "ab"
    r = await chat(client, stream=True, n=2)
    seq = []
    for c in chunks(r.text):
        (choice,) = c["choices"]
        seq.append((choice["index"], choice["delta"], choice["finish_reason"]))
    assert seq == [
        (0, {"role": "assistant", "content": ""}, None),
        (1, {"role": "assistant", "content": ""}, None),
        (0, {"content": "a"}, None),
        (1, {"content": "a"}, None),
        (0, {"content": "b"}, None),
        (0, {}, "stop"),
        (1, {"content": "b"}, None),
        (1, {"content": " "}, None),
        (1, {"content": "1"}, None),
        (1, {}, "stop"),
    ]


async def test_non_streaming_n2(client, fake):
    r = await chat(client, n=2, max_completion_tokens=3)
    body = r.json()
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "Hel", "length"),
        (1, "Hel", "length"),
    ]
    assert body["usage"]["completion_tokens"] == 6
    assert fake.generate_calls[0][3].n == 2


async def test_logprobs_chat_format(client):
    r = await chat(client, logprobs=True, top_logprobs=2, max_tokens=2)
    lp = r.json()["choices"][0]["logprobs"]
    assert lp == {
        "content": [
            {
                "token": "H",
                "logprob": -0.5,
                "bytes": [72],
                "top_logprobs": [
                    {"token": "H", "logprob": -0.5, "bytes": [72]},
                    {"token": "a", "logprob": -1.0, "bytes": [97]},
                ],
            },
            {
                "token": "e",
                "logprob": -0.5,
                "bytes": [101],
                "top_logprobs": [
                    {"token": "e", "logprob": -0.5, "bytes": [101]},
                    {"token": "a", "logprob": -1.0, "bytes": [97]},
                ],
            },
        ],
        "refusal": None,
    }


async def test_logprobs_in_stream_and_without_top(client, fake):
    r = await chat(client, logprobs=True, max_tokens=1, stream=True)
    content = [c for c in chunks(r.text) if c["choices"][0]["delta"].get("content")]
    assert content[0]["choices"][0]["logprobs"] == {
        "content": [{"token": "H", "logprob": -0.5, "bytes": [72], "top_logprobs": []}],
        "refusal": None,
    }
    assert fake.generate_calls[0][3].logprobs == 0


async def test_top_logprobs_needs_logprobs(client):
    r = await chat(client, top_logprobs=2)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "top_logprobs"


async def test_every_sampling_field_reaches_the_engine(client, fake):
    r = await chat(
        client,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        min_tokens=1,
        ignore_eos=True,
        stop_token_ids=[7],
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        speculative_decoding=False,
        seed=42,
        stop="xyz",
        logit_bias={"5": 10},
        max_tokens=4,
        max_completion_tokens=3,
        n=1,
        user="u",
        metadata={"k": "v"},
        store=False,
        parallel_tool_calls=False,
        service_tier="auto",
        prompt_cache_key="k",
        safety_identifier="s",
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
        modalities=["text"],
        reasoning_effort="none",
    )
    assert r.status_code == 200, r.text
    p = fake.generate_calls[0][3]
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.5, 0.9, 5, 0.1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (p.min_tokens, p.ignore_eos, p.stop_token_ids, p.skip_special_tokens) == (1, True, [7], False)
    assert (p.include_stop_str_in_output, p.seed, p.stop, p.logit_bias) == (True, 42, ["xyz"], {5: 10.0})
    assert p.max_tokens == 3  # max_completion_tokens wins over max_tokens
    assert p.speculative is False


async def test_defaults_are_the_engines(client, fake):
    await chat(client)
    p = fake.generate_calls[0][3]
    assert (p.temperature, p.top_p, p.top_k, p.n, p.logprobs, p.stop) == (1.0, 1.0, -1, 1, None, [])
    assert p.speculative is True  # speculative decoding applies wherever the server has it


@pytest.mark.parametrize(
    "field,value,param",
    [
        ("temperature", -1, "temperature"),
        ("top_p", 0, "top_p"),
        ("presence_penalty", 3, "presence_penalty"),
        ("max_tokens", 0, "max_tokens"),
        ("max_completion_tokens", 0, "max_completion_tokens"),
        ("logit_bias", {"x": 1}, "logit_bias"),
        ("logit_bias", {"1": 1000}, "logit_bias"),
        ("n", 0, "n"),
        ("n", 1000, "n"),
        ("stop", [""], "stop"),
        ("top_logprobs", 50, "top_logprobs"),
        ("temperature", "hot", "temperature"),
        ("seed", 2**70, "seed"),
        ("stop_token_ids", [-1], "stop_token_ids[0]"),
    ],
)
async def test_invalid_sampling_fields_are_400_naming_the_field(client, field, value, param):
    r = await chat(client, **{field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert param.split("[")[0] in err["message"]


@pytest.mark.parametrize(
    "field,value",
    [
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("audio", {"voice": "alloy", "format": "mp3"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("web_search_options", {}),
        ("reasoning_effort", "high"),
        ("verbosity", "low"),
        ("moderation", {"model": "omni-moderation-latest"}),
        ("store", True),
    ],
)
async def test_unsupported_openai_fields_are_rejected_by_name(client, field, value):
    r = await chat(client, **{field: value})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == field
    assert field in err["message"] and "not supported" in err["message"]


async def test_unknown_field_is_rejected(client):
    r = await chat(client, guided_decoding_backend="outlines")
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "Unrecognized request argument supplied: guided_decoding_backend",
        "type": "invalid_request_error",
        "param": "guided_decoding_backend",
        "code": None,
    }


async def test_stream_options_without_stream(client):
    r = await chat(client, stream_options={"include_usage": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


async def test_messages_render_roles_parts_and_developer(client, fake):
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "42", "tool_call_id": "1"},
        {"role": "system", "content": [{"type": "text", "text": "s"}], "name": "sys"},
    ]
    r = await chat(
        client, messages=messages, chat_template_kwargs={"enable_thinking": False}, add_generation_prompt=False
    )
    assert r.status_code == 200, r.text
    call = fake.template_calls[0]
    assert call["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "tool_calls": messages[2]["tool_calls"]},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
        {"role": "system", "content": "s", "name": "sys"},
    ]
    assert call["add_generation_prompt"] is False
    assert call["enable_thinking"] is False
    assert call["chat_template"] is None


@pytest.mark.parametrize(
    "messages,param",
    [
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
            "messages[0].content[0].type",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": "x", "extra": 1}], "messages[0].extra"),
        ([], "messages"),
        ([{"role": "assistant", "content": "x", "audio": {"id": "a"}}], "messages[0].audio"),
    ],
)
async def test_bad_messages(client, messages, param):
    r = await chat(client, messages=messages)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_chat_template_kwargs_cannot_shadow(client):
    r = await chat(client, chat_template_kwargs={"messages": []})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "chat_template_kwargs.messages"


async def test_template_failure_is_400(client, fake):
    fake.template_error = ValueError("Conversation roles must alternate user/assistant")
    r = await chat(client)
    assert r.status_code == 400
    assert "roles must alternate" in r.json()["error"]["message"]


async def test_chat_template_override_is_passed(fake, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    async with make_client(make_app(fake, chat_template=template)) as client:
        assert (await chat(client)).status_code == 200
    assert fake.template_calls[0]["chat_template"] == "{{ messages }}"


async def test_unknown_model_is_404(client):
    r = await chat(client, model="nope")
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": "The model `nope` does not exist.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


async def test_embedding_model_cannot_chat(client):
    r = await chat(client, model="fake-embed")
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "model_not_supported"


async def test_missing_model_is_400(client):
    r = await client.post("/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "model"
    assert r.json()["error"]["message"] == "Missing required parameter: 'model'."


async def test_context_overflow_is_checked_by_the_api(client, fake):
    fake.max_model_len = 64
    r = await chat(client, max_tokens=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert err["param"] == "messages"
    assert err["message"] == (
        f"This model's maximum context length is 64 tokens. However, you requested {PROMPT_TOKENS + 60} tokens "
        f"({PROMPT_TOKENS} in the messages, 60 in the completion). Please reduce the length of the messages or completion."
    )
    assert fake.generate_calls == []


async def test_context_overflow_without_max_tokens(client, fake):
    fake.max_model_len = PROMPT_TOKENS
    r = await chat(client)
    assert r.status_code == 400
    assert f"your messages resulted in {PROMPT_TOKENS} tokens" in r.json()["error"]["message"]


async def test_connector_error_before_first_output(client, fake):
    fake.raise_on_start = ContextLengthExceeded("too long for the engine")
    r = await chat(client)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = await chat(client, stream=True)
    assert r.status_code == 400  # admission errors come before the stream starts
    assert r.json()["error"]["message"] == "too long for the engine"
    assert fake.aborted == []  # never admitted: nothing to abort


async def test_engine_error_mid_stream_sends_error_event_then_done(client, fake):
    fake.error_after = 2
    r = await chat(client, stream=True)
    assert r.status_code == 200
    evs = events(r.text)
    assert evs[-1] == "[DONE]"
    assert json.loads(evs[-2]) == {
        "error": {
            "message": "The engine failed the request: boom",
            "type": "server_error",
            "param": None,
            "code": "engine_error",
        }
    }
    assert [json.loads(e)["choices"][0]["delta"].get("content") for e in evs[1:3]] == ["H", "e"]


async def test_exception_mid_stream_hides_the_trace(client, fake):
    fake.raise_after = 1
    r = await chat(client, stream=True)
    evs = events(r.text)
    assert evs[-1] == "[DONE]"
    err = json.loads(evs[-2])["error"]
    assert err["type"] == "server_error"
    assert "exploded" not in err["message"] and "Traceback" not in r.text
    assert fake.aborted == ["chatcmpl-test"]  # the unfinished request is aborted


async def test_engine_error_non_streaming_is_500_envelope(client, fake):
    fake.error_after = 1
    r = await chat(client)
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "engine_error"


async def test_503_while_loading(client, fake):
    fake.healthy = False
    r = await chat(client)
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "service_unavailable_error"
    assert "Retry-After" in r.headers


async def test_finished_request_is_not_aborted(client, fake):
    await chat(client)
    await chat(client, stream=True)
    assert fake.aborted == []
