"""No request can hurt another: hostile inputs against a real ``servelm serve`` while three streams run.

Each input that once crashed an engine step, broke an error path or froze
the event loop is sent while three ordinary streams are generating. Every
hostile request gets its own 4xx (or its 200 where the input is fine), never
a 5xx; the three bystanders end with ``finish_reason: length``, no error
event, and exactly the text they produce when run alone.

Bounded: 127.0.0.1 only, a few dozen requests, 32 tokens per bystander.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from .conftest import CHAT_MODEL, EMBEDDING_MODEL, server_process

pytestmark = pytest.mark.model

TIMEOUT = 300.0  # a safety net per request; nothing here waits on a clock
BYSTANDER_TOKENS = 32
BIG = "lighthouse keeper " * (7_800_000 // len("lighthouse keeper "))  # 7.8 MB, as in the report
CHAT = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 2}
COMPLETION = {"model": CHAT_MODEL, "prompt": "Hello", "max_tokens": 2}


def bystander(i: int) -> dict:
    return {
        "model": CHAT_MODEL,
        "messages": [{"role": "user", "content": f"Tell story number {i} about a lighthouse keeper."}],
        "max_tokens": BYSTANDER_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
    }


# (name, path, raw JSON body as text, expected status, expected param or code)
HOSTILE: list[tuple[str, str, str, int, str | None]] = [
    ("top_p 1e-300", "/v1/chat/completions", json.dumps({**CHAT, "top_p": 1e-300}), 400, "top_p"),
    (
        "repetition_penalty 1e-40",
        "/v1/chat/completions",
        json.dumps({**CHAT, "repetition_penalty": 1e-40}),
        400,
        "repetition_penalty",
    ),
    (
        "temperature 1e39",
        "/v1/chat/completions",
        json.dumps({**CHAT, "temperature": 1e39, "min_tokens": 3}),
        400,
        "temperature",
    ),
    ("top_p 5e-324", "/v1/completions", json.dumps({**COMPLETION, "top_p": 5e-324}), 400, "top_p"),
    (
        "surrogate in chat",
        "/v1/chat/completions",
        json.dumps({**CHAT, "messages": [{"role": "user", "content": "a\ud800b"}]}),
        400,
        "messages[0].content",
    ),
    ("surrogate in prompt", "/v1/completions", json.dumps({**COMPLETION, "prompt": "a\udfffb"}), 400, "prompt"),
    ("surrogate to tokenize", "/tokenize", json.dumps({"model": CHAT_MODEL, "prompt": "a\ud800"}), 400, "prompt"),
    (
        "surrogate to embeddings",
        "/v1/embeddings",
        json.dumps({"model": EMBEDDING_MODEL, "input": "\ud800"}),
        400,
        "input",
    ),
    ("surrogate model", "/v1/chat/completions", json.dumps({**CHAT, "model": "\ud800"}), 400, "model"),
    ("n null", "/v1/chat/completions", json.dumps({**CHAT, "n": None}), 200, None),
    (
        "extensions null",
        "/v1/chat/completions",
        json.dumps(
            {
                **CHAT,
                "min_tokens": None,
                "ignore_eos": None,
                "skip_special_tokens": None,
                "include_stop_str_in_output": None,
                "add_generation_prompt": None,
            }
        ),
        200,
        None,
    ),
    (
        "encoding_format null",
        "/v1/embeddings",
        json.dumps({"model": EMBEDDING_MODEL, "input": "hi", "encoding_format": None}),
        200,
        None,
    ),
    ("logit_bias -1", "/v1/chat/completions", json.dumps({**CHAT, "logit_bias": {"-1": 1}}), 400, "logit_bias"),
    (
        "logit_bias 1e9",
        "/v1/chat/completions",
        json.dumps({**CHAT, "logit_bias": {"1000000000": 1}}),
        400,
        "logit_bias",
    ),
    (
        "stop_token_ids huge",
        "/v1/completions",
        json.dumps({**COMPLETION, "stop_token_ids": [10**9]}),
        400,
        "stop_token_ids",
    ),
    (
        "stop_token_ids float",
        "/v1/completions",
        json.dumps({**COMPLETION, "stop_token_ids": [1e9]}),
        400,
        "stop_token_ids[0]",
    ),
    ("max_tokens true", "/v1/chat/completions", json.dumps({**CHAT, "max_tokens": True}), 400, "max_tokens"),
    ("stream yes", "/v1/chat/completions", json.dumps({**CHAT, "stream": "yes"}), 400, "stream"),
    ("negative token id", "/v1/completions", json.dumps({**COMPLETION, "prompt": [1, -1]}), 400, "prompt"),
    ("nested too deep", "/v1/completions", "[" * 200_000 + "]" * 200_000, 400, "invalid_json"),
    ("big prompt to tokenize", "/tokenize", json.dumps({"model": CHAT_MODEL, "prompt": BIG}), 200, None),
    (
        "big prompt to chat",
        "/v1/chat/completions",
        json.dumps({**CHAT, "messages": [{"role": "user", "content": BIG}]}),
        400,
        "context_length_exceeded",
    ),
]


async def _stream(client: httpx.AsyncClient, body: dict, first: asyncio.Event) -> tuple[str, list]:
    events = []
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
                if any(
                    isinstance(e, dict) and e.get("choices") and e["choices"][0]["delta"].get("content")
                    for e in events[-1:]
                ):
                    first.set()
    first.set()
    chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)
    return text, events


async def _hostile(client: httpx.AsyncClient, name: str, path: str, raw: str, status: int, expect: str | None):
    payload = raw.encode("utf-8") if name != "invalid utf-8" else raw.encode("latin-1")
    r = await client.post(path, content=payload, headers={"content-type": "application/json"})
    assert r.status_code == status, f"{name}: {r.status_code} {r.text[:300]}"
    if status >= 400:
        error = r.json()["error"]
        assert expect in (error["param"], error["code"]), f"{name}: {error}"
        assert "Traceback" not in r.text and "RuntimeError" not in r.text


def test_hostile_inputs_leave_three_streams_intact():
    args = ["--model", CHAT_MODEL, "--embedding-model", EMBEDDING_MODEL, "--max-body-bytes", str(32 << 20)]
    with server_process(args) as server:
        asyncio.run(_scenario(server.url))
        assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200


async def _scenario(url: str) -> None:
    limits = httpx.Limits(max_connections=16)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT, limits=limits) as client:
        # What each bystander says when it runs alone (greedy, so the text is fixed).
        alone = []
        for i in range(3):
            r = await client.post("/v1/chat/completions", json=bystander(i))
            assert r.status_code == 200, r.text
            alone.append(r.json()["choices"][0]["message"]["content"])

        firsts = [asyncio.Event() for _ in range(3)]
        streams = [asyncio.create_task(_stream(client, bystander(i), firsts[i])) for i in range(3)]
        for ev in firsts:
            await ev.wait()  # every bystander is generating
        # The big prompts take seconds to tokenize: they run alongside the rest.
        heavy = [asyncio.create_task(_hostile(client, *case)) for case in HOSTILE if case[0].startswith("big")]
        invalid_utf8 = ("invalid utf-8", "/v1/completions", '{"model": "\xff\xfe", "prompt": "x"}', 400, "invalid_json")
        for case in [*HOSTILE, invalid_utf8]:
            if not case[0].startswith("big"):
                await _hostile(client, *case)
                assert (await client.get("/ping")).status_code == 200
        await asyncio.gather(*heavy)
        results = await asyncio.gather(*streams)

    for i, (text, events) in enumerate(results):
        assert events[-1] == "[DONE]", events[-3:]
        assert not any(isinstance(e, dict) and "error" in e for e in events), f"bystander {i}: {events[-3:]}"
        finishes = [e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict) and e.get("choices")]
        assert finishes[-1] == "length"
        assert text == alone[i], f"bystander {i} changed: {text!r} != {alone[i]!r}"
