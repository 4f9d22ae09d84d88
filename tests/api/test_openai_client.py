"""The official openai client, sync and async, streamed and not, against the app."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import ThreadedServer, make_app

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def async_client(app):
    return openai.AsyncOpenAI(
        base_url="http://testserver/v1",
        api_key="unused",
        http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)),
        max_retries=0,
    )


@pytest.fixture
def sync_client(live_server):
    with openai.OpenAI(base_url=live_server + "/v1", api_key="unused", max_retries=0, timeout=10) as client:
        yield client


async def test_async_chat(async_client):
    r = await async_client.chat.completions.create(
        model="fake-chat", messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=1
    )
    assert r.choices[0].message.content == "Hello"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens_details.cached_tokens == 2
    assert [t.token for t in r.choices[0].logprobs.content] == list("Hello")
    assert r.id == "chatcmpl-test" and r.system_fingerprint.startswith("fp_")


async def test_async_chat_stream_with_usage(async_client):
    stream = await async_client.chat.completions.create(
        model="fake-chat", messages=MESSAGES, stream=True, n=2, stream_options={"include_usage": True}
    )
    texts = {0: "", 1: ""}
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: "Hello world", 1: "Hello world 1"}
    assert usage.completion_tokens == 11 + 13


async def test_async_completions_and_embeddings(async_client):
    r = await async_client.completions.create(model="fake-chat", prompt=["a", "b"], max_tokens=2, echo=True, logprobs=1)
    assert [c.text for c in r.choices] == ["aHe", "bHe"]
    assert r.choices[0].logprobs.tokens == ["", "a", "H", "e"]
    stream = await async_client.completions.create(model="fake-chat", prompt="a", max_tokens=3, stream=True)
    assert "".join([c.choices[0].text async for c in stream]) == "Hel"
    # The client asks for base64 by default and decodes it.
    e = await async_client.embeddings.create(model="fake-embed", input=["ab", "c"])
    assert len(e.data) == 2 and len(e.data[0].embedding) == 4
    assert e.data[0].embedding == pytest.approx(
        (await async_client.embeddings.create(model="fake-embed", input="ab", encoding_format="float"))
        .data[0]
        .embedding,
        rel=1e-6,
    )
    models = await async_client.models.list()
    assert [m.id for m in models.data] == ["fake-chat", "fake-embed"]


async def test_async_errors_are_typed(async_client):
    with pytest.raises(openai.NotFoundError) as exc:
        await async_client.chat.completions.create(model="nope", messages=MESSAGES)
    assert exc.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as exc:
        await async_client.chat.completions.create(model="fake-chat", messages=MESSAGES, temperature=-2)
    assert exc.value.param == "temperature"


def test_sync_chat_and_stream(sync_client):
    r = sync_client.chat.completions.create(model="fake-chat", messages=MESSAGES, max_completion_tokens=2)
    assert r.choices[0].message.content == "He"
    stream = sync_client.chat.completions.create(model="fake-chat", messages=MESSAGES, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Hello world"


def test_sync_completions_embeddings_and_stream_error(sync_client, fake):
    assert sync_client.completions.create(model="fake-chat", prompt="x", max_tokens=1).choices[0].text == "H"
    assert len(sync_client.embeddings.create(model="fake-embed", input="x").data[0].embedding) == 4
    fake.error_after = 1
    with pytest.raises(openai.APIError) as exc:
        for _ in sync_client.chat.completions.create(model="fake-chat", messages=MESSAGES, stream=True):
            pass
    assert "boom" in str(exc.value)


def test_sync_auth(fake):
    with ThreadedServer(make_app(fake, api_keys=["k"])) as url:
        with openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        with openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as good:
            assert len(good.models.list().data) == 2
