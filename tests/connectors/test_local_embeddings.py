"""The local connector on the bundled embedding model: requests take turns on the encoder, a
cancelled one stops, and /tokenize and /detokenize use the embedding model's tokenizer.

Every wait below ends on a state (an event, a queue length, a thread ending); the
deadlines are only safety nets for a hung test.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from servelm.api import create_app
from servelm.connectors.base import ConnectorError, ModelNotFound
from servelm.connectors.local import LocalConnector, TurnLock
from servelm.engine.outputs import EmbeddingOutput
from servelm.settings import Settings

pytestmark = pytest.mark.model

EMBED = "all-minilm-l6-v2"
HELLO = [101, 7592, 102]  # [CLS] hello [SEP]
# Sixteen inputs of one length, two per sub-batch: eight sub-batches.
WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight"]
WORDS += ["nine", "ten", "red", "blue", "green", "black", "white", "brown"]
BIG = [f"sentence {word} is here" for word in WORDS]
SUB_BATCH = 2
SAFETY_NET_S = 120.0


@pytest.fixture(scope="module")
def conn() -> LocalConnector:
    conn = LocalConnector(None, EMBED)
    conn.load()
    return conn


@pytest.fixture(scope="module")
def big_reference(conn: LocalConnector) -> list[EmbeddingOutput]:
    """BIG embedded in one call, as the connector's sub-batches will run it."""
    conn.embedder.max_batch_size = SUB_BATCH
    try:
        return conn.embedder.embed(BIG)
    finally:
        conn.embedder.max_batch_size = 32


class SubBatches:
    """Records which request each encoder sub-batch belongs to, and holds BIG's first one until let go."""

    def __init__(self) -> None:
        self.runs: list[str] = []
        self.big_started = threading.Event()
        self.let_go = threading.Event()


@pytest.fixture
def sub_batches(conn: LocalConnector, big_reference, monkeypatch: pytest.MonkeyPatch) -> SubBatches:
    seen = SubBatches()
    run = conn.embedder._embed_batch

    def hooked(batch: list[list[int]]) -> list[list[float]]:
        kind = "small" if batch == [HELLO] else "big"
        seen.runs.append(kind)
        if kind == "big" and not seen.big_started.is_set():
            seen.big_started.set()
            assert seen.let_go.wait(SAFETY_NET_S)
        return run(batch)

    monkeypatch.setattr(conn.embedder, "_embed_batch", hooked)
    monkeypatch.setattr(conn.embedder, "max_batch_size", SUB_BATCH)
    return seen


async def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + SAFETY_NET_S
    while not condition():
        assert time.monotonic() < deadline, "the state never came"
        await asyncio.sleep(0.005)


async def embed_threads_ended() -> None:
    for thread in threading.enumerate():
        if thread.name == "servelm-embed":
            await asyncio.to_thread(thread.join, SAFETY_NET_S)
            assert not thread.is_alive()


async def test_a_cancelled_request_stops_after_its_sub_batch_and_the_next_is_served_at_once(conn, sub_batches):
    big = asyncio.create_task(conn.embed(EMBED, BIG))
    assert await asyncio.to_thread(sub_batches.big_started.wait, SAFETY_NET_S)
    big.cancel()  # what the API does when the client hangs up
    with pytest.raises(asyncio.CancelledError):
        await big
    sub_batches.let_go.set()

    (small,) = await conn.embed(EMBED, ["hello"])
    assert sub_batches.runs == ["big", "small"]  # not the big one's seven other sub-batches first
    assert small.num_tokens == 3 and len(small.embedding) == 384
    await embed_threads_ended()
    assert sub_batches.runs == ["big", "small"]  # and they never ran


async def test_a_request_arriving_mid_way_is_served_between_the_big_ones_sub_batches(conn, sub_batches, big_reference):
    big = asyncio.create_task(conn.embed(EMBED, BIG))
    assert await asyncio.to_thread(sub_batches.big_started.wait, SAFETY_NET_S)
    small = asyncio.create_task(conn.embed(EMBED, ["hello"]))
    await until(lambda: conn._embed_turns.waiting == 1)  # the small one waits for the encoder
    sub_batches.let_go.set()

    (out,) = await small
    assert out.num_tokens == 3
    assert sub_batches.runs[:2] == ["big", "small"]  # served before the big one's second sub-batch
    got = await big
    assert sub_batches.runs == ["big", "small"] + ["big"] * (len(BIG) // SUB_BATCH - 1)
    # Taking turns changes nothing in the results, which come in input order.
    assert got == big_reference
    await embed_threads_ended()


def test_turn_lock_hands_over_in_the_order_asked():
    lock = TurnLock()
    order: list[str] = []

    def take(name: str) -> None:
        with lock:
            order.append(name)

    lock.__enter__()
    waiters = []
    for name in ("first", "second"):
        waiters.append(threading.Thread(target=take, args=(name,)))
        waiters[-1].start()
        deadline = time.monotonic() + SAFETY_NET_S
        while lock.waiting < len(waiters):
            assert time.monotonic() < deadline
            time.sleep(0.001)
    lock.__exit__(None, None, None)
    take("holder again")  # asking again at once queues behind those already waiting
    for thread in waiters:
        thread.join(SAFETY_NET_S)
    assert order == ["first", "second", "holder again"]
    assert lock.waiting == 0
    take("free")  # and a free lock is taken at once
    assert order[-1] == "free"


async def test_tokenize_honours_add_special_tokens(conn):
    assert await conn.tokenize(EMBED, "hello") == HELLO
    assert await conn.tokenize(EMBED, "hello", add_special_tokens=True) == HELLO
    assert await conn.tokenize(EMBED, "hello", add_special_tokens=False) == [7592]


async def test_detokenize_uses_the_embedding_models_tokenizer(conn):
    assert await conn.detokenize(EMBED, HELLO) == "[CLS] hello [SEP]"
    assert await conn.detokenize(EMBED, [7592, 2088]) == "hello world"
    with pytest.raises(ConnectorError) as err:
        await conn.detokenize(EMBED, [7592, 30522])
    assert err.value.status == 400 and err.value.param == "tokens" and "30522" in str(err.value)
    with pytest.raises(ModelNotFound):
        await conn.detokenize("no-such-model", HELLO)


async def test_tokenize_and_detokenize_over_http(conn):
    app = create_app(conn, Settings())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        r = await client.post("/tokenize", json={"model": EMBED, "prompt": "hello", "add_special_tokens": False})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == [7592] and r.json()["count"] == 1
        r = await client.post("/tokenize", json={"model": EMBED, "prompt": "hello"})
        assert r.json()["tokens"] == HELLO
        r = await client.post("/detokenize", json={"model": EMBED, "tokens": HELLO})
        assert r.status_code == 200, r.text
        assert r.json() == {"prompt": "[CLS] hello [SEP]"}
        r = await client.post("/v1/detokenize", json={"model": EMBED, "tokens": [30522]})  # past the vocabulary
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
