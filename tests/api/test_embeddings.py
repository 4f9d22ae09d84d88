"""POST /v1/embeddings against the fake connector."""

from __future__ import annotations

import base64
import struct

import pytest

from .fake_connector import EMBED_MODEL, encode


async def embed(client, **body):
    body.setdefault("model", EMBED_MODEL)
    return await client.post("/v1/embeddings", json=body)


@pytest.mark.parametrize(
    "inp,expected",
    [
        ("ab", ["ab"]),
        (["ab", "c"], ["ab", "c"]),
        ([5, 6], [[5, 6]]),
        ([[5, 6], [7]], [[5, 6], [7]]),
    ],
)
async def test_input_forms(client, fake, inp, expected):
    r = await embed(client, input=inp)
    assert r.status_code == 200, r.text
    body = r.json()
    assert fake.embed_calls == [expected]
    assert body["object"] == "list" and body["model"] == EMBED_MODEL
    assert [d["index"] for d in body["data"]] == list(range(len(expected)))
    assert all(d["object"] == "embedding" and len(d["embedding"]) == 4 for d in body["data"])
    tokens = sum(len(encode(x)) if isinstance(x, str) else len(x) for x in expected)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


async def test_base64_is_little_endian_float32(client):
    floats = (await embed(client, input="ab")).json()["data"][0]["embedding"]
    b64 = (await embed(client, input="ab", encoding_format="base64")).json()["data"][0]["embedding"]
    raw = base64.b64decode(b64)
    assert len(raw) == 4 * 4
    decoded = struct.unpack("<4f", raw)
    assert decoded == pytest.approx(floats, rel=1e-6)


async def test_dimensions(client):
    assert (await embed(client, input="a", dimensions=4)).status_code == 200
    r = await embed(client, input="a", dimensions=2)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "dimensions"
    assert "4-dimensional" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "inp,param",
    [([], "input"), ([[1], []], "input[1]"), ([-1], "input"), ("", "input"), (["a", ""], "input[1]")],
)
async def test_bad_inputs(client, fake, inp, param):
    r = await embed(client, input=inp)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] is not None
    assert r.json()["error"]["param"].startswith(param.split("[")[0])
    if inp in ("", ["a", ""]):  # an empty string, as OpenAI: nothing to embed
        assert r.json()["error"]["param"] == param and "empty string" in r.json()["error"]["message"]
        assert fake.embed_calls == []


async def test_too_many_inputs(client):
    r = await embed(client, input=["a"] * 2049)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


async def test_token_input_over_context(client):
    r = await embed(client, input=[5] * 40)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert err["message"].startswith(
        "This model's maximum context length is 32 tokens. However, you requested 40 tokens in the input."
    )


async def test_engine_side_overflow_keeps_the_envelope(client):
    r = await embed(client, input="x" * 40)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


async def test_chat_model_cannot_embed(client):
    r = await embed(client, model="fake-chat", input="a")
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


async def test_bad_encoding_format(client):
    r = await embed(client, input="a", encoding_format="hex")
    assert r.status_code == 400 and r.json()["error"]["param"] == "encoding_format"
