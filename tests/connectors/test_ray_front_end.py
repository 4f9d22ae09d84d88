"""The HTTP front end over the Ray connector, without a cluster: health, admission, replicas, metrics.

The connector reads the replicas' figures from the stats board the replicas
push to (``ray_stats.py``); here the board is a list the test edits, and the
deployment handle is an in-memory stand-in that answers the model list and
streams a short reply. What is checked is the front end's view of a
deployment: /health is 503 once no replica serves, ``--max-waiting`` counts
the requests waiting on every replica, /v1/replicas and /metrics show each
replica and their sum, and a request whose replicas keep dying is resumed
three times, then gets docs/API.md's 503 ``replica_failed``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from servelm.api import create_app
from servelm.connectors.base import ConnectorError, ModelCard
from servelm.connectors.ray import RayConnector
from servelm.engine.outputs import CompletionOutput, RequestOutput
from servelm.settings import Settings
from tests.api.test_error_table import documented_rows
from tests.connectors.serve_fakes import Handle, StandInEngine, replica

MODEL = "fake-chat"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def snapshot(
    replica: str,
    *,
    running: int = 0,
    waiting: int = 0,
    kv: float = 0.0,
    state: str = "RUNNING",
    age_s: float = 0.0,
    request_ids: list[str] | None = None,
) -> dict[str, Any]:
    """One replica's entry on the stats board, as ``EngineReplica`` pushes it."""
    return {
        "replica": replica,
        "node_id": f"node-{replica}",
        "node_ip": "127.0.0.1",
        "pid": 100,
        "state": state,
        "running": running,
        "waiting": waiting,
        "kv_cache_usage": kv,
        "request_ids": request_ids or [],
        "age": age_s,  # as the board gives it
        "engines": [
            {
                "model": MODEL,
                "num_running": running,
                "num_waiting": waiting,
                "kv_cache_usage": kv,
                "prefix_cache_queries": 10,
                "prefix_cache_hits": 4,
                "num_preemptions": 0,
            }
        ],
    }


class ShortReplyEngine(StandInEngine):
    """Each replica's engine: a two-token reply, or, ``dying``, one token and then its loop's death."""

    def __init__(self) -> None:
        self.dying = False
        self.gate: asyncio.Event | None = None  # set: each reply waits for it

    async def generate(self, model: str, request_id: str, prompt, params) -> AsyncIterator[RequestOutput]:
        if self.gate is not None:
            await self.gate.wait()
        if self.dying:
            out = CompletionOutput(index=0, text="a", token_ids=[7])
            yield RequestOutput(request_id, None, list(prompt), [out], delta=True, num_generated_tokens=1)
            # LocalConnector's error when the engine loop died.
            raise ConnectorError(
                "The engine is down.", status=503, type="service_unavailable_error", code="engine_dead"
            )
        out = CompletionOutput(index=0, text="ok", token_ids=[7, 8], finish_reason="length")
        yield RequestOutput(request_id, None, list(prompt), [out], finished=True, delta=True, num_generated_tokens=2)


class FakeHandle(Handle):
    """Two in-memory replicas; ``dying = True`` makes every replica die one token into each stream."""

    def __init__(self) -> None:
        self.engine = ShortReplyEngine()
        answers = {
            "models": [ModelCard(MODEL, "generate", 256)],
            "apply_chat_template": "<user>hi</user>",
            "tokenize": [1, 2, 3],
            "detokenize": "x",
        }
        super().__init__([replica(self.engine, "a"), replica(self.engine, "b")], answers)

    @property
    def dying(self) -> bool:
        return self.engine.dying

    @dying.setter
    def dying(self, value: bool) -> None:
        self.engine.dying = value


@pytest.fixture
async def deployment():
    """(connector, board, handle): the board is the list of snapshots the connector reads."""
    board: list[dict[str, Any]] = []

    async def read() -> list[dict[str, Any]]:
        return [dict(s) for s in board]

    handle = FakeHandle()
    connector = RayConnector(handle=handle, board_reader=read)
    yield connector, board, handle
    if connector._poller is not None:  # the background reader of the board
        await connector._poller.stop()
    connector.shutdown()


def client(connector: RayConnector, **settings: Any) -> httpx.AsyncClient:
    # model_construct: the defaults, without reading SERVELM_* from the developer's shell.
    app = create_app(connector, Settings.model_construct(**settings))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_health_is_200_while_one_replica_serves_and_503_when_none_does(deployment):
    connector, board, _ = deployment
    async with client(connector) as c:
        await connector.refresh_stats()
        assert (await c.get("/health")).status_code == 503  # no replica has reported yet

        board[:] = [snapshot("a"), snapshot("b", state="DEAD")]
        await connector.refresh_stats()
        assert (await c.get("/health")).status_code == 200
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200

        # "a" falls silent (killed: it no longer reports) and "b" is still dead.
        board[:] = [snapshot("a", age_s=60), snapshot("b", state="DEAD")]
        await connector.refresh_stats()
        r = await c.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.headers["retry-after"]
        states = {d["replica"]: d["state"] for d in (await c.get("/v1/replicas")).json()["data"]}
        assert states == {"a": "UNRESPONSIVE", "b": "DEAD"}
        assert (await c.get("/v1/replicas")).json()["serving"] == 0

        board[:] = [snapshot("a2"), snapshot("b", state="DEAD")]  # Serve restarted it
        await connector.refresh_stats()
        assert (await c.get("/health")).status_code == 200


async def test_max_waiting_counts_the_requests_waiting_on_every_replica(deployment):
    connector, board, handle = deployment
    async with client(connector, max_waiting=4) as c:
        # 2 + 1 waiting: under the limit of 4, though each replica alone is far under it.
        board[:] = [snapshot("a", running=8, waiting=2), snapshot("b", running=8, waiting=1)]
        await connector.refresh_stats()
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert len(handle.generated) == 1

        # 2 + 2 waiting: the cluster's queue is full, though neither replica's is.
        board[:] = [snapshot("a", running=8, waiting=2), snapshot("b", running=8, waiting=2)]
        await connector.refresh_stats()
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
        assert "4 requests are already waiting" in r.json()["error"]["message"]
        assert len(handle.generated) == 1  # refused before any replica was asked

        # A silent replica's queue no longer counts.
        board[:] = [snapshot("a", waiting=2), snapshot("b", waiting=2, age_s=60)]
        await connector.refresh_stats()
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def test_max_waiting_holds_for_a_burst_the_replicas_have_not_reported_yet(deployment):
    connector, board, handle = deployment
    handle.engine.gate = gate = asyncio.Event()  # no reply until the test says
    board[:] = [snapshot("a"), snapshot("b")]
    await connector.refresh_stats()
    async with client(connector, max_waiting=4) as c:
        burst = [asyncio.create_task(c.post("/v1/chat/completions", json={**CHAT, "n": 2})) for _ in range(5)]
        # The board still says nothing waits: only what this front end sent counts. Two requests
        # of two sequences each fill the queue of 4, and the other three are refused at once.
        refused = [t for t in burst if t.done() or await _done_soon(t)]
        assert [t.result().status_code for t in refused] == [429, 429, 429]
        assert [t.result().json()["error"]["code"] for t in refused] == ["queue_full"] * 3
        sent = list(connector._unstarted)
        assert len(sent) == 2 and len(handle.generated) == 2

        # Once a report shows the replicas' engines holding them, they count there and only there.
        board[:] = [snapshot("a", waiting=2, request_ids=sent[:1]), snapshot("b", waiting=2, request_ids=sent[1:])]
        await connector.refresh_stats()
        assert (await connector.queue_depth()).waiting == 4
        board[:] = [snapshot("a", waiting=1, request_ids=sent[:1]), snapshot("b", running=2, request_ids=sent[1:])]
        await connector.refresh_stats()
        assert (await connector.queue_depth()).waiting == 1

        gate.set()
        admitted = [t for t in burst if t not in refused]
        assert [(await t).status_code for t in admitted] == [200, 200]
        assert connector._unstarted == {}  # a request with output waits no more


async def _done_soon(task: asyncio.Task) -> bool:
    """Whether ``task`` ends while the loop has nothing else to do (a refused request does)."""
    for _ in range(1000):
        if task.done():
            return True
        await asyncio.sleep(0)
    return False


async def test_replicas_and_metrics_show_each_replica_and_the_sum(deployment):
    connector, board, _ = deployment
    board[:] = [snapshot("a", running=3, waiting=1, kv=0.5), snapshot("b", running=1, kv=0.25)]
    async with client(connector) as c:
        await connector.refresh_stats()
        body = (await c.get("/v1/replicas")).json()
        assert body["serving"] == 2
        rows = {d["replica"]: (d["state"], d["running"], d["waiting"], d["kv_cache_usage"]) for d in body["data"]}
        assert rows == {"a": ("RUNNING", 3, 1, 0.5), "b": ("RUNNING", 1, 0, 0.25)}

        m = samples((await c.get("/metrics")).text)
    running = "servelm:num_requests_running"
    assert m[(running, (("model_name", MODEL), ("replica", "a")))] == 3
    assert m[(running, (("model_name", MODEL), ("replica", "b")))] == 1
    assert m[(running, (("model_name", MODEL),))] == 4  # the deployment's sum has no replica label
    assert m[("servelm:prefix_cache_hits_total", (("model_name", MODEL),))] == 8
    assert m[("servelm:kv_cache_usage_perc", (("model_name", MODEL),))] == pytest.approx(0.375)  # the mean


async def test_a_request_whose_replicas_keep_dying_gets_the_documented_503(deployment):
    connector, board, handle = deployment
    handle.dying = True
    board[:] = [snapshot("a"), snapshot("b")]
    async with client(connector) as c:
        await connector.refresh_stats()
        r = await c.post("/v1/chat/completions", json=CHAT)
        error = r.json()["error"]
        assert (r.status_code, error["type"], error["code"]) == (503, "service_unavailable_error", "replica_failed")
        assert len(handle.generated) == 4  # the first replica, then 3 migrations
        # Each migration resumes from the tokens the client already has.
        assert [g["prompt"] for g in handle.generated] == [[1, 2, 3], [1, 2, 3, 7], [1, 2, 3, 7, 7], [1, 2, 3, 7, 7, 7]]
        assert any(
            503 in st and "service_unavailable_error" in ty and "replica_failed" in co
            for st, ty, co in documented_rows()
        ), "docs/API.md's error table lacks replica_failed"

        # Streamed: the text so far, then the error as an event, then [DONE].
        r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8, "stream": True})
        assert r.status_code == 200
        events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["error"]["code"] == "replica_failed"
        text = "".join(
            json.loads(e)["choices"][0]["delta"].get("content") or ""
            for e in events[:-2]
            if json.loads(e).get("choices")
        )
        assert text == "aaaa"  # one token from each replica, none lost or repeated


async def test_a_call_whose_client_left_is_cancelled_on_the_replica_too(deployment):
    # Serve leaves a unary call running when its caller is cancelled; the connector cancels it.
    connector, _, handle = deployment
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def slow_embed(model: str, inputs: list[str]) -> list[Any]:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return []

    handle.answers["embed"] = slow_embed
    call = asyncio.create_task(connector.embed("fake-embed", ["x"]))
    await started.wait()
    call.cancel()  # what the API does when the client hangs up
    with pytest.raises(asyncio.CancelledError):
        await call
    await cancelled.wait()
