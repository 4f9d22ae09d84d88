"""Big text work leaves the event loop free: /ping answers while a 10 MB prompt is being tokenized.

The app runs in-process around the local connector on the bundled model.
The tokenizer is instrumented, not replaced: on a big input it signals that
the server has reached it, then waits for the test to let it go on to the
real work. The test pings in between. Had the work run on the event loop,
the ping could only be answered after the big request had finished (the
instrument lets go by itself after a safety-net wait), and the test fails.
No wall-clock bound is asserted: only the order of events.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from servelm.api import create_app
from servelm.connectors.local import LocalConnector
from servelm.engine.config import EngineConfig
from servelm.engine.off_loop import OFF_LOOP_SIZE
from servelm.settings import Settings

pytestmark = pytest.mark.model

MODEL = "smollm2-135m-instruct"
BIG = "lighthouse keeper " * (10_000_000 // len("lighthouse keeper "))  # 10 MB of text
SAFETY_NET_S = 300.0  # only a hung test waits this long
# How long a gated call waits for the test before going on by itself. Only
# reached when the call blocks the loop (the test cannot ping, so cannot
# release it); it bounds how long the failing case takes to fail.
GATE_TIMEOUT_S = 60.0


class Gate:
    """Holds big-input calls at their start until released, recording that one has arrived."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def wrap(self, fn: Callable[..., Any], size: Callable[..., int]) -> Callable[..., Any]:
        def gated(*args: Any, **kwargs: Any) -> Any:
            if size(*args, **kwargs) > OFF_LOOP_SIZE:
                self.entered.set()
                self.release.wait(GATE_TIMEOUT_S)
            return fn(*args, **kwargs)

        return gated


@pytest.fixture(scope="module")
def connector():
    conn = LocalConnector(MODEL, None, EngineConfig(dtype="float32", device="cpu", kv_cache_memory=64 << 20))
    conn.load()
    yield conn
    conn.shutdown()


@pytest.fixture
def gate(connector, monkeypatch) -> Gate:
    gate = Gate()
    tok = connector.engine.engine.tokenizer
    monkeypatch.setattr(tok, "encode", gate.wrap(tok.encode, lambda text, **_: len(text)))
    monkeypatch.setattr(tok, "decode", gate.wrap(tok.decode, lambda ids, **_: len(ids)))
    render = gate.wrap(tok.apply_chat_template, lambda messages, **_: len(messages[0]["content"]))
    monkeypatch.setattr(tok, "apply_chat_template", render)
    return gate


REQUESTS = {
    "tokenize": ("/tokenize", {"model": MODEL, "prompt": BIG}),
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": BIG}], "max_tokens": 1}),
    "detokenize": ("/detokenize", {"model": MODEL, "tokens": [42] * 1_000_000}),
}


@pytest.mark.parametrize("name", list(REQUESTS))
async def test_ping_answers_while_a_big_request_is_processed(connector, gate, name):
    path, body = REQUESTS[name]
    app = create_app(connector, Settings(max_body_bytes=64 << 20))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=SAFETY_NET_S) as client:
        big = asyncio.create_task(client.post(path, json=body))
        # The server has parsed the body and reached the heavy work.
        assert await asyncio.to_thread(gate.entered.wait, SAFETY_NET_S)
        ping = await client.get("/ping")
        assert ping.status_code == 200
        assert not big.done(), "the big request finished before /ping was answered: it blocked the event loop"
        gate.release.set()
        r = await big
    if name == "chat":
        # 10 MB is far over the context: the answer comes only after rendering and tokenizing it.
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    elif name == "tokenize":
        assert r.status_code == 200 and r.json()["count"] > 1_000_000
    else:
        assert r.status_code == 200 and len(r.json()["prompt"]) > 0


async def test_small_inputs_stay_on_the_loop(connector, monkeypatch):
    # A short prompt does not pay for a thread hop: no worker thread sees it.
    threads: list[str] = []
    tok = connector.engine.engine.tokenizer
    real = tok.encode

    def recording(text: str, **kwargs: Any) -> list[int]:
        threads.append(threading.current_thread().name)
        return real(text, **kwargs)

    monkeypatch.setattr(tok, "encode", recording)
    assert await connector.tokenize(MODEL, "hello there") == real("hello there")
    assert threads == [threading.main_thread().name]
