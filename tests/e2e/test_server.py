"""End to end: the real ``servelm serve`` process on the bundled models, driven by the openai SDK and httpx.

Every request goes to 127.0.0.1, one at a time, with small ``max_tokens``:
the bundled model decodes a few dozen tokens a second on a small CPU.
"""

from __future__ import annotations

import base64
import json
import math
import re
import struct
import time

import httpx
import openai
import pytest

from .conftest import CHAT_MODEL, EMBEDDING_MODEL, RAY_STARTUP_TIMEOUT_S, STARTUP_TIMEOUT_S, running_server

pytestmark = pytest.mark.model

MESSAGES = [{"role": "user", "content": "Name a planet of the solar system."}]
PROMPT = "The capital of France is"
TIMEOUT = 300.0  # a safety net per request; nothing here waits on a clock
SAFETY_NET_S = 300.0  # only a hung test waits this long: every wait below ends on a state


@pytest.fixture(scope="module", params=["local", "ray"])
def server(request):
    """Base URL of a ``servelm serve`` on both bundled models: the engine in process, then
    two engine replicas on Ray Serve (``--replicas 2``). Every test here runs against both."""
    args = ["--model", CHAT_MODEL, "--embedding-model", EMBEDDING_MODEL]
    timeout = STARTUP_TIMEOUT_S
    if request.param == "ray":
        args += ["--replicas", "2", "--replica-cpus", "1"]
        timeout = RAY_STARTUP_TIMEOUT_S
    with running_server(args, startup_timeout_s=timeout) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture
async def async_client(server):
    async with openai.AsyncOpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def greedy_chat(client):
    """The non-streamed greedy reply to MESSAGES: the reference the streamed replies must equal."""
    return client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, max_tokens=12, temperature=0)


def _prompt_token_count(http: httpx.Client, messages) -> int:
    r = http.post("/tokenize", json={"model": CHAT_MODEL, "messages": messages, "add_generation_prompt": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"])
    return body["count"]


def _max_model_len(http: httpx.Client, model: str) -> int:
    r = http.get("/v1/models")
    assert r.status_code == 200
    return next(m["max_model_len"] for m in r.json()["data"] if m["id"] == model)


def _assert_error(response: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


# --- chat completions --------------------------------------------------------


def test_chat_completion(client, http, greedy_chat):
    prompt_tokens = _prompt_token_count(http, MESSAGES)
    r = client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True)
    assert r.id.startswith("chatcmpl-")
    assert r.object == "chat.completion" and r.model == CHAT_MODEL
    [choice] = r.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content
    assert choice.message.content == greedy_chat.choices[0].message.content  # greedy is reproducible
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == prompt_tokens
    # The logprobs are the content's tokens: not the end-of-turn token, which usage counts.
    assert "".join(e.token for e in choice.logprobs.content) == choice.message.content
    assert r.usage.completion_tokens == len(choice.logprobs.content) + (choice.finish_reason == "stop")
    assert 1 <= r.usage.completion_tokens <= 12
    assert choice.finish_reason == "stop" or r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_completion_ignore_eos_counts_max_tokens(client, http):
    r = client.chat.completions.create(
        model=CHAT_MODEL, messages=MESSAGES, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens == _prompt_token_count(http, MESSAGES)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_chat_completion_without_max_tokens(client):
    # No max_tokens means "up to the context". This server's KV cache (256 MiB,
    # about 5800 tokens) is smaller than the context (8192): a request that
    # leaves max_tokens out must still be served. The stop strings end it
    # after the first sentence. The timeout is only a safety net against a hang:
    # how long that sentence takes depends on how busy the machine is.
    r = client.with_options(timeout=300.0).chat.completions.create(
        model=CHAT_MODEL, messages=MESSAGES, temperature=0, stop=[".", "\n"]
    )
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_chat_stream_sync(client, http, greedy_chat):
    stream = client.chat.completions.create(
        model=CHAT_MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    choice_chunks = [c for c in chunks if c.choices]
    assert choice_chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.id.startswith("chatcmpl-") for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in choice_chunks)
    assert text == greedy_chat.choices[0].message.content
    assert choice_chunks[-1].choices[0].finish_reason == greedy_chat.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
    # include_usage: one last chunk with no choices carries the usage; the others carry none.
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert last.usage.prompt_tokens == _prompt_token_count(http, MESSAGES)
    assert last.usage.completion_tokens == greedy_chat.usage.completion_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


async def test_chat_stream_async(async_client, greedy_chat):
    stream = await async_client.chat.completions.create(
        model=CHAT_MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    choice_chunks = [c for c in chunks if c.choices]
    assert choice_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in choice_chunks) == greedy_chat.choices[0].message.content
    assert choice_chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == greedy_chat.usage.completion_tokens


async def test_chat_async_non_streaming(async_client, greedy_chat):
    r = await async_client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert r.id.startswith("chatcmpl-")
    assert r.choices[0].message.content == greedy_chat.choices[0].message.content


# --- completions -------------------------------------------------------------


def test_completions_n2_seeded(client, http):
    kwargs = dict(model=CHAT_MODEL, prompt=PROMPT, max_tokens=8, n=2, temperature=1.0, seed=1234)
    r = client.completions.create(**kwargs)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert (
        r.usage.prompt_tokens == http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    )  # once, not per choice
    assert 2 <= r.usage.completion_tokens <= 16
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible


def test_completions_logprobs(client):
    r = client.completions.create(model=CHAT_MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    choice = r.choices[0]
    lp = choice.logprobs
    n = len(lp.tokens)
    assert n + (choice.finish_reason == "stop") == r.usage.completion_tokens >= 1
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == choice.text
    offset = 0
    for token, logprob, top, start in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert start == offset
        offset += len(token)
        assert logprob <= 0.0
        assert token in top and 1 <= len(top) <= 3  # the chosen token is always listed
        assert top[token] == pytest.approx(logprob, abs=1e-4)
        assert logprob == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the most likely


def test_completions_echo_logprobs(client):
    r = client.completions.create(model=CHAT_MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, echo=True)
    choice = r.choices[0]
    assert choice.text.startswith(PROMPT)
    assert len(choice.text) > len(PROMPT)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None
    assert all(x is not None for x in lp.token_logprobs[1:])
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
    assert "".join(lp.tokens) == choice.text


def test_completions_stop_string(client):
    base = dict(model=CHAT_MODEL, prompt="Count: 1, 2, 3,", max_tokens=16, temperature=0)
    free = client.completions.create(**base).choices[0].text
    words = free.split()
    assert len(words) >= 3, free
    stop = " " + words[2]  # a string the unconstrained greedy text contains, past its start
    cut = free.index(stop)
    r = client.completions.create(**base, stop=[stop], logprobs=1)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert stop not in choice.text
    assert choice.text == free[:cut]
    assert "".join(choice.logprobs.tokens) == choice.text  # the stop string's tokens are cut too
    streamed = client.completions.create(**base, stop=[stop], logprobs=1, stream=True)
    tokens = [
        t for chunk in streamed if chunk.choices and chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.tokens
    ]
    assert "".join(tokens) == choice.text


def _escaped_bytes(token: str) -> bytes:
    """A logprob token's bytes: its text, with ``\\xNN`` escapes for the bytes of an unfinished character."""
    out, i = bytearray(), 0
    while i < len(token):
        if re.match(r"\\x[0-9a-f]{2}", token[i : i + 4]):
            out.append(int(token[i + 2 : i + 4], 16))
            i += 4
        else:
            out += token[i].encode()
            i += 1
    return bytes(out)


def test_logprobs_of_tokens_holding_part_of_a_character(client, http):
    # Emoji and CJK characters take several tokens each: every token keeps its own bytes.
    prompt = "Party: 🎉🎉 and 日本語 🇫🇷"
    r = client.completions.create(model=CHAT_MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3, echo=True)
    choice = r.choices[0]
    lp = choice.logprobs
    assert "\ufffd" not in "".join(lp.tokens[: r.usage.prompt_tokens])
    raw = [_escaped_bytes(t) for t in lp.tokens]
    assert any(_not_utf8(b) for b in raw)  # the prompt has tokens with part of a character
    assert b"".join(raw).decode("utf-8", errors="replace") == choice.text
    for i, offset in enumerate(lp.text_offset):  # where each token's character starts
        assert offset == len(b"".join(raw[:i]).decode("utf-8", errors="ignore"))
    for top in lp.top_logprobs[1:]:
        assert len(top) >= 3  # distinct tokens are distinct keys, never all "\ufffd"
    chat = http.post(
        "/v1/chat/completions",
        json={
            "model": CHAT_MODEL,
            "messages": [{"role": "user", "content": "Reply with three party emojis."}],
            "max_tokens": 12,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ).json()["choices"][0]
    entries = chat["logprobs"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8", errors="replace") == chat["message"]["content"]
    for e in entries:
        assert _escaped_bytes(e["token"]) == bytes(e["bytes"])


def _not_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_completions_stream_matches_non_streamed(client):
    base = dict(model=CHAT_MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    whole = client.completions.create(**base).choices[0]
    chunks = list(client.completions.create(**base, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == whole.finish_reason


def test_structured_output_reaches_the_engine_and_its_errors_come_back(client, http):
    # Locally and through Ray replicas (the spec is pickled; the grammar compiles on the replica).
    r = client.chat.completions.create(
        model=CHAT_MODEL,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0.7,
        seed=1,
        extra_body={"guided_choice": ["Mars", "Venus"]},
    )
    assert r.choices[0].message.content in ("Mars", "Venus") and r.choices[0].finish_reason == "stop"
    bad = http.post(
        "/v1/chat/completions",
        json={
            "model": CHAT_MODEL,
            "messages": MESSAGES,
            "max_tokens": 5,
            "structured_outputs": {"grammar": "root ::= nowhere"},
        },
    )
    _assert_error(bad, 400, code="invalid_structured_output", param="structured_outputs.grammar")


# --- embeddings --------------------------------------------------------------


def _norm(vector) -> float:
    return math.sqrt(sum(x * x for x in vector))


def test_embeddings(client, http):
    one = client.embeddings.create(model=EMBEDDING_MODEL, input="The cat sat on the mat.", encoding_format="float")
    assert one.model == EMBEDDING_MODEL and len(one.data) == 1
    vector = one.data[0].embedding
    assert len(vector) == 384
    assert _norm(vector) == pytest.approx(1.0, abs=1e-3)
    assert one.usage.prompt_tokens > 0 and one.usage.total_tokens == one.usage.prompt_tokens

    texts = ["The cat sat on the mat.", "A stock market report.", "A kitten rests on a rug."]
    many = client.embeddings.create(model=EMBEDDING_MODEL, input=texts, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    vectors = [d.embedding for d in many.data]
    assert all(len(v) == 384 and _norm(v) == pytest.approx(1.0, abs=1e-3) for v in vectors)
    assert vectors[0] == pytest.approx(vector, abs=1e-5)  # batched or not, the same embedding
    cosine = [sum(a * b for a, b in zip(vectors[0], v)) for v in vectors[1:]]
    assert cosine[1] > cosine[0]  # the kitten is nearer the cat than the stock market is

    # The SDK asks for base64 by default and decodes it itself.
    decoded = client.embeddings.create(model=EMBEDDING_MODEL, input=texts).data
    for d, v in zip(decoded, vectors):
        assert d.embedding == pytest.approx(v, abs=1e-6)

    # The raw base64 body: little-endian float32, the same numbers.
    r = http.post("/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": texts[0], "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    encoded = r.json()["data"][0]["embedding"]
    assert isinstance(encoded, str)
    raw = base64.b64decode(encoded)
    assert len(raw) == 384 * 4
    assert list(struct.unpack("<384f", raw)) == pytest.approx(vector, abs=1e-6)


# --- models ------------------------------------------------------------------


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    assert CHAT_MODEL in ids and EMBEDDING_MODEL in ids
    model = client.models.retrieve(CHAT_MODEL)
    assert model.id == CHAT_MODEL and model.object == "model" and model.owned_by == "servelm"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


# --- raw HTTP: SSE framing and error bodies -----------------------------------


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"model": CHAT_MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0}),
        ("/v1/completions", {"model": CHAT_MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}),
    ],
)
def test_sse_framing(http, path, body):
    with http.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")
    assert events[-1] == ""  # every event, the last included, ends with a blank line
    events = events[:-1]
    assert events[-1] == "data: [DONE]"
    assert len(events) >= 3
    parsed = []
    for event in events[:-1]:
        assert event.startswith("data: ") and "\n" not in event, repr(event)
        parsed.append(json.loads(event[len("data: ") :]))
    assert all("error" not in p for p in parsed)
    assert parsed[-1]["choices"] == [] and parsed[-1]["usage"]["completion_tokens"] >= 1
    assert len({p["id"] for p in parsed}) == 1


def test_error_unknown_model(http, client):
    r = http.post("/v1/chat/completions", json={"model": "no-such-model", "messages": MESSAGES, "max_tokens": 2})
    error = _assert_error(r, 404, code="model_not_found", param="model")
    assert "no-such-model" in error["message"]
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    assert exc.value.code == "model_not_found"


def test_error_prompt_too_long(http):
    max_len = _max_model_len(http, CHAT_MODEL)
    token = http.post("/tokenize", json={"prompt": " hello", "add_special_tokens": False}).json()["tokens"][0]
    prompt_len = max_len + 1
    r = http.post("/v1/completions", json={"model": CHAT_MODEL, "prompt": [token] * prompt_len, "max_tokens": 1})
    error = _assert_error(r, 400, code="context_length_exceeded")
    assert str(max_len) in error["message"]
    assert str(prompt_len) in error["message"]


def test_error_invalid_temperature(http, client):
    r = http.post(
        "/v1/chat/completions", json={"model": CHAT_MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": -1}
    )
    error = _assert_error(r, 400, param="temperature")
    assert "temperature" in error["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=CHAT_MODEL, prompt=PROMPT, max_tokens=2, temperature=-1)
    assert exc.value.param == "temperature"


def test_error_malformed_json(http):
    r = http.post(
        "/v1/chat/completions", content=b'{"model": "x", "messages": [', headers={"Content-Type": "application/json"}
    )
    _assert_error(r, 400, code="invalid_json")


def test_error_embedding_model_cannot_generate(http):
    r = http.post("/v1/chat/completions", json={"model": EMBEDDING_MODEL, "messages": MESSAGES, "max_tokens": 2})
    _assert_error(r, 400, code="model_not_supported")


# --- a client that disconnects mid-stream --------------------------------------


def _metric_sum(http: httpx.Client, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples on /metrics that carry ``labels``."""
    r = http.get("/metrics")
    assert r.status_code == 200
    total = 0.0
    for line in r.text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_disconnect_mid_stream_aborts_the_request():
    # A server of its own that runs one sequence at a time, so the counts
    # below are this request's alone.
    with running_server(["--model", CHAT_MODEL, "--embedding-model", "none", "--max-num-seqs", "1"]) as url:
        with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
            body = {
                "model": CHAT_MODEL,
                "messages": MESSAGES,
                "max_tokens": 1000,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                # Hold on to the iterator: dropping it would already close the connection.
                lines = r.iter_lines()
                events = []
                for line in lines:
                    if line.startswith("data: "):
                        events.append(json.loads(line[len("data: ") :]))
                    if len(events) == 2:
                        break
                assert events[0]["choices"][0]["delta"]["role"] == "assistant"
                assert _metric_sum(http, "servelm:num_requests_running") == 1  # still streaming
            # Leaving the block closed the connection mid-stream.

            # The engine lets the request go: nothing runs, and it ended as an
            # abort, long before its 1000 tokens. (Waits on the state; the
            # deadline is only a safety net.)
            deadline = time.monotonic() + SAFETY_NET_S
            while _metric_sum(http, "servelm:num_requests_running") != 0:
                assert time.monotonic() < deadline, "the abandoned request still runs"
                time.sleep(0.1)
            assert _metric_sum(http, "servelm:request_success_total", finished_reason="abort") == 1
            assert _metric_sum(http, "servelm:request_success_total", finished_reason="length") == 0
            assert _metric_sum(http, "servelm:generation_tokens_total") < 1000
            assert _metric_sum(http, "servelm:kv_cache_usage_perc") == 0

            r = http.post(
                "/v1/chat/completions",
                json={"model": CHAT_MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4


# --- tokenize / detokenize with the embedding model ------------------------------


def test_tokenize_and_detokenize_with_the_embedding_model(http):
    hello = [101, 7592, 102]  # [CLS] hello [SEP]
    r = http.post("/tokenize", json={"model": EMBEDDING_MODEL, "prompt": "hello"})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == hello
    r = http.post("/tokenize", json={"model": EMBEDDING_MODEL, "prompt": "hello", "add_special_tokens": False})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == [7592]
    r = http.post("/detokenize", json={"model": EMBEDDING_MODEL, "tokens": hello})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": "[CLS] hello [SEP]"}
    _assert_error(http.post("/detokenize", json={"model": EMBEDDING_MODEL, "tokens": [30522]}), 400, param="tokens")
