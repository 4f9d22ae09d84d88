"""The HTTP edge: strict types, null as the default, no lone surrogates, clear token id
and JSON errors, and sampling values checked in the sampler's float32."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel

from servelm.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    StreamOptions,
    TokenizeRequest,
)

from .fake_connector import VOCAB_SIZE

CHAT = {"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5}
COMPLETION = {"model": "fake-chat", "prompt": "x", "max_tokens": 5}


def user(content: Any) -> dict:
    return {"role": "user", "content": content}


def error_of(r, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


async def post_raw(client, path: str, body: Any):
    """POST ``body`` as ASCII JSON, so lone surrogates travel as ``\\ud800`` escapes."""
    return await client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


# --- strict types -------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "field", "value", "shown"),
    [
        ("/v1/chat/completions", "max_tokens", True, "got true"),
        ("/v1/chat/completions", "stream", "yes", 'got "yes"'),
        ("/v1/chat/completions", "n", "2", 'got "2"'),
        ("/v1/chat/completions", "temperature", "0.5", 'got "0.5"'),
        ("/v1/chat/completions", "logprobs", 1, "got 1"),
        ("/v1/chat/completions", "seed", 1.5, "got 1.5"),
        ("/v1/completions", "max_tokens", 2.0, "got 2.0"),
        ("/v1/completions", "echo", "true", 'got "true"'),
        ("/v1/completions", "ignore_eos", 0, "got 0"),
        ("/v1/completions", "speculative_decoding", "false", 'got "false"'),
    ],
)
async def test_types_are_strict(client, fake, path, field, value, shown):
    body = {**(CHAT if "chat" in path else COMPLETION), field: value}
    err = error_of(await client.post(path, json=body))
    assert err["param"] == field and shown in err["message"], err
    assert fake.generate_calls == []


async def test_an_integer_is_a_number(client):
    r = await client.post("/v1/chat/completions", json={**CHAT, "temperature": 1, "top_p": 1})
    assert r.status_code == 200, r.text


async def test_messages_print_values_as_json(client):
    options = {"search_context_size": "low", "strict": True}
    r = await client.post("/v1/chat/completions", json={**CHAT, "web_search_options": options})
    err = error_of(r)
    assert '"strict": true' in err["message"] and "True" not in err["message"]
    r = await client.post("/v1/embeddings", json={"model": "fake-embed", "input": "x", "encoding_format": "hex"})
    err = error_of(r)
    assert err["param"] == "encoding_format" and '"float"' in err["message"] and "'float'" not in err["message"]
    err = error_of(await client.post("/v1/chat/completions", json={**CHAT, "stop": ["ok", ""]}))
    assert err["param"] == "stop" and '["ok", ""]' in err["message"]


# --- null means the default -----------------------------------------------------

BASES: list[tuple[str, type[BaseModel], dict[str, Any]]] = [
    ("/v1/chat/completions", ChatCompletionRequest, CHAT),
    ("/v1/completions", CompletionRequest, COMPLETION),
    ("/v1/embeddings", EmbeddingRequest, {"model": "fake-embed", "input": "x"}),
    ("/tokenize", TokenizeRequest, {"model": "fake-chat", "prompt": "x"}),
    ("/detokenize", DetokenizeRequest, {"model": "fake-chat", "tokens": [70, 71]}),
]
OPTIONAL_FIELDS = [
    (path, name, base)
    for path, model, base in BASES
    for name, info in model.model_fields.items()
    if not info.is_required() and name not in base
]


@pytest.mark.parametrize(("path", "name", "base"), OPTIONAL_FIELDS, ids=[f"{p}:{n}" for p, n, _ in OPTIONAL_FIELDS])
async def test_every_optional_field_accepts_null_as_its_default(client, path, name, base):
    expected = await client.post(path, json=base)
    assert expected.status_code == 200, expected.text
    r = await client.post(path, json={**base, name: None})
    assert r.status_code == 200, r.text
    assert r.json() == expected.json()


def test_the_walk_covers_the_fields_the_issue_names():
    walked = {(p, n) for p, n, _ in OPTIONAL_FIELDS}
    for name in (
        "n",
        "min_tokens",
        "ignore_eos",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "add_generation_prompt",
        "stream",
        "logit_bias",
        "stop_token_ids",
    ):
        assert ("/v1/chat/completions", name) in walked
    assert ("/v1/embeddings", "encoding_format") in walked


NESTED = [
    ("messages[0]", ChatMessage, {"role": "assistant", "content": "x"}),
    ("stream_options", StreamOptions, {"include_usage": True}),
]


@pytest.mark.parametrize(
    ("where", "name", "base"),
    [(w, n, b) for w, m, b in NESTED for n, info in m.model_fields.items() if not info.is_required() and n not in b],
)
async def test_nested_optional_fields_accept_null(client, where, name, base):
    if where == "stream_options":
        body = {**CHAT, "stream": True, "stream_options": {**base, name: None}}
    else:
        body = {**CHAT, "messages": [{**base, name: None}, {"role": "user", "content": "y"}]}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


async def test_null_on_a_required_field_is_still_an_error(client):
    err = error_of(await client.post("/v1/chat/completions", json={**CHAT, "model": None}))
    assert err["param"] == "model" and "got null" in err["message"]


# --- lone surrogates --------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {**CHAT, "messages": [user("a\ud800b")]}, "messages[0].content"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
            "messages[0].content[0].text",
        ),
        ("/v1/chat/completions", {**CHAT, "model": "\ud800"}, "model"),
        ("/v1/chat/completions", {**CHAT, "stop": ["ok", "x\udc00"]}, "stop[1]"),
        ("/v1/chat/completions", {**CHAT, "metadata": {"k\ud800": "v"}}, "metadata"),
        ("/v1/chat/completions", {**CHAT, "\udfff": 1}, None),
        ("/v1/completions", {**COMPLETION, "prompt": "a\udfffb"}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": ["ok", "\ud800"]}, "prompt[1]"),
        ("/v1/embeddings", {"model": "fake-embed", "input": "\ud800"}, "input"),
        ("/tokenize", {"model": "fake-chat", "prompt": "a\ud800"}, "prompt"),
        ("/tokenize", {"model": "fake-chat", "messages": [user("\ud800")]}, "messages[0].content"),
    ],
)
async def test_a_lone_surrogate_is_a_400_naming_the_field(client, fake, path, body, param):
    err = error_of(await post_raw(client, path, body))
    assert err["param"] == param and "surrogate" in err["message"], err
    assert fake.generate_calls == [] and fake.template_calls == []


async def test_a_paired_surrogate_is_fine(client):
    r = await post_raw(client, "/v1/chat/completions", {**CHAT, "messages": [user("\U0001f600")]})
    assert r.status_code == 200, r.text


# --- token ids ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param", "where"),
    [
        ("/v1/completions", {**COMPLETION, "prompt": [5, -1]}, "prompt", "[1] is -1"),
        ("/v1/completions", {**COMPLETION, "prompt": [[5], [6, -7]]}, "prompt", "[1][1] is -7"),
        ("/v1/completions", {**COMPLETION, "prompt": [2**31]}, "prompt", f"[0] is {2**31}"),
        ("/v1/embeddings", {"model": "fake-embed", "input": [-3]}, "input", "[0] is -3"),
    ],
)
async def test_a_negative_prompt_token_id_gets_a_clear_message(client, path, body, param, where):
    err = error_of(await client.post(path, json=body))
    assert err["param"] == param and "token ids must be integers in [0, 2147483647]" in err["message"], err
    assert where in err["message"] and "valid string" not in err["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", {"-1": 5}),
        ("logit_bias", {str(10**9): 5}),
        ("logit_bias", {str(VOCAB_SIZE): 5}),
        ("stop_token_ids", [VOCAB_SIZE]),
        ("stop_token_ids", [10**9]),
    ],
)
async def test_token_ids_outside_the_vocabulary_are_400(client, field, value):
    for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        err = error_of(await client.post(path, json={**base, field: value}))
        assert err["param"] == field and "outside the model's vocabulary" in err["message"], err


async def test_a_float_token_id_is_not_an_integer(client):
    err = error_of(await client.post("/v1/chat/completions", json={**CHAT, "stop_token_ids": [1e9]}))
    assert err["param"] == "stop_token_ids[0]" and "valid integer" in err["message"]


async def test_token_ids_inside_the_vocabulary_are_fine(client):
    body = {**CHAT, "logit_bias": {str(VOCAB_SIZE - 1): 5}, "stop_token_ids": [0, VOCAB_SIZE - 1]}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200


# --- JSON that does not parse ---------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": ',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"model": "\xff\xfe", "prompt": "x"}',
        b'{"a": 1}}',
        b'{"model": "fake-chat", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
    ],
    ids=["truncated", "nested-too-deep", "invalid-utf8", "trailing", "integer-too-long"],
)
async def test_undecodable_json_is_invalid_json(client, raw):
    r = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    err = error_of(r)
    assert err["code"] == "invalid_json" and "not valid JSON" in err["message"], err
    if b"0" * 5000 in raw:
        assert "4300 digits" in err["message"]


# --- sampling values in float32 -----------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/chat/completions", "top_p", 1e-300),
        ("/v1/chat/completions", "repetition_penalty", 1e-40),
        ("/v1/chat/completions", "temperature", 1e39),
        ("/v1/chat/completions", "min_p", 1e-45),
        ("/v1/completions", "top_p", 5e-324),
        ("/v1/completions", "presence_penalty", -1e-320),
    ],
)
async def test_sampling_values_that_float32_cannot_hold_are_400(client, fake, path, field, value):
    base = CHAT if "chat" in path else COMPLETION
    err = error_of(await client.post(path, json={**base, field: value, "min_tokens": 3}))
    assert err["param"] == field and "float32" in err["message"], err
    assert fake.generate_calls == []
