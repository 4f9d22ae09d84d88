"""Every error is OpenAI's envelope with the right status; nothing leaks a traceback."""

from __future__ import annotations

import logging

import pytest


def assert_envelope(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def test_unknown_route_404(client):
    err = assert_envelope(await client.get("/v1/nothing"), 404)
    assert err["message"] == "Invalid URL (GET /v1/nothing)"


async def test_wrong_method_405(client):
    r = await client.get("/v1/chat/completions")
    err = assert_envelope(r, 405)
    assert "GET" in err["message"]
    assert "POST" in r.headers["allow"]


async def test_invalid_json_400(client):
    r = await client.post("/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    err = assert_envelope(r, 400)
    assert err["code"] == "invalid_json"


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"null"])
async def test_body_must_be_an_object(client, body):
    r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    err = assert_envelope(r, 400)
    assert "JSON object" in err["message"]


async def test_json_without_content_type_is_accepted(client):
    r = await client.post("/v1/completions", content=b'{"model": "fake-chat", "prompt": "a", "max_tokens": 1}')
    assert r.status_code == 200


async def test_empty_body(client):
    r = await client.post("/v1/completions")
    assert_envelope(r, 400)


async def test_wrong_type_names_the_nested_field(client):
    r = await client.post(
        "/v1/chat/completions",
        json={
            "model": "fake-chat",
            "messages": [{"role": "user", "content": "x"}],
            "stream_options": {"include_usage": "maybe"},
        },
    )
    err = assert_envelope(r, 400)
    assert err["param"] == "stream_options.include_usage"


async def test_unexpected_exception_is_a_bare_500(client, fake, caplog, monkeypatch):
    async def broken(*args, **kwargs):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(fake, "tokenize", broken)
    with caplog.at_level(logging.ERROR, logger="servelm.api"):
        r = await client.post("/v1/completions", json={"model": "fake-chat", "prompt": "a"})
    err = assert_envelope(r, 500)
    assert err["type"] == "server_error"
    assert "secret" not in r.text and "Traceback" not in r.text
    assert "secret internals" in caplog.text  # logged server-side


async def test_exception_in_models_is_a_bare_500(client, fake, monkeypatch):
    async def broken():
        raise KeyError("x")

    monkeypatch.setattr(fake, "models", broken)
    assert_envelope(await client.get("/v1/models"), 500)
