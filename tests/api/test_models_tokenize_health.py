"""/v1/models, /tokenize, /detokenize, /health, /ping, /version, /metrics."""

from __future__ import annotations

import pytest

from servelm.api.serving_base import servelm_version

from .fake_connector import encode


async def test_models(client):
    r = await client.get("/v1/models")
    assert r.status_code == 200
    assert r.json() == {
        "object": "list",
        "data": [
            {
                "id": "fake-chat",
                "object": "model",
                "created": 1700000000,
                "owned_by": "servelm",
                "root": "/models/fake-chat.gguf",
                "parent": None,
                "max_model_len": 256,
            },
            {
                "id": "fake-embed",
                "object": "model",
                "created": 1700000000,
                "owned_by": "servelm",
                "root": "/models/fake-embed",
                "parent": None,
                "max_model_len": 32,
            },
        ],
    }


async def test_model_by_id(client):
    r = await client.get("/v1/models/fake-embed")
    assert r.status_code == 200 and r.json()["id"] == "fake-embed"
    r = await client.get("/v1/models/org/missing")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("prefix", ["", "/v1"])
async def test_tokenize_prompt(client, prefix):
    r = await client.post(f"{prefix}/tokenize", json={"model": "fake-chat", "prompt": "ab"})
    assert r.status_code == 200
    assert r.json() == {"count": 3, "max_model_len": 256, "tokens": encode("ab")}
    r = await client.post(f"{prefix}/tokenize", json={"prompt": "ab", "add_special_tokens": False})
    assert r.json()["tokens"] == encode("ab", add_special_tokens=False)


async def test_tokenize_messages_matches_chat_rendering(client, fake):
    r = await client.post("/tokenize", json={"model": "fake-chat", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200
    assert r.json()["tokens"] == encode("<|user|>x\n<|assistant|>", add_special_tokens=False)
    r = await client.post(
        "/tokenize", json={"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False}
    )
    assert r.json()["tokens"] == encode("<|user|>x\n", add_special_tokens=False)


async def test_tokenize_needs_exactly_one_input(client):
    assert (await client.post("/tokenize", json={})).status_code == 400
    both = {"prompt": "a", "messages": [{"role": "user", "content": "x"}]}
    assert (await client.post("/tokenize", json=both)).status_code == 400


async def test_tokenize_embedding_model(client):
    r = await client.post("/tokenize", json={"model": "fake-embed", "prompt": "a"})
    assert r.json()["max_model_len"] == 32


@pytest.mark.parametrize("prefix", ["", "/v1"])
async def test_detokenize(client, prefix):
    r = await client.post(f"{prefix}/detokenize", json={"model": "fake-chat", "tokens": encode("héllo")})
    assert r.status_code == 200 and r.json() == {"prompt": "héllo"}
    r = await client.post(f"{prefix}/detokenize", json={"tokens": [-1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[0]"


async def test_health_and_ping(client, fake):
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/ping")).status_code == 200
    fake.healthy = False
    r = await client.get("/health")
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "model_not_ready"
    assert (await client.get("/ping")).status_code == 200


async def test_version(client):
    r = await client.get("/version")
    assert r.json() == {"version": servelm_version()}


async def test_metrics_counts_requests_and_tokens(client):
    await client.post("/v1/completions", json={"model": "fake-chat", "prompt": "ab", "max_tokens": 4})
    await client.post("/v1/completions", json={"model": "nope", "prompt": "ab"})
    await client.get("/v1/models/fake-chat")
    await client.get("/no/such/route")
    r = await client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert 'servelm:http_requests_total{method="POST",route="/v1/completions",status="200"} 1.0' in text
    assert 'servelm:http_requests_total{method="POST",route="/v1/completions",status="404"} 1.0' in text
    assert 'servelm:http_requests_total{method="GET",route="/v1/models/{model_id:path}",status="200"} 1.0' in text
    assert 'servelm:http_requests_total{method="GET",route="unmatched",status="404"} 1.0' in text
    assert 'servelm:prompt_tokens_total{model_name="fake-chat"} 3.0' in text
    assert 'servelm:generation_tokens_total{model_name="fake-chat"} 4.0' in text
    assert 'servelm:num_requests_running{model_name="fake-chat"} 0.0' in text


async def test_each_app_has_its_own_registry(fake):
    from .conftest import make_app, make_client

    a, b = make_app(fake), make_app(fake)
    async with make_client(a) as ca, make_client(b) as cb:
        await ca.get("/ping")
        text = (await cb.get("/metrics")).text
    assert 'route="/ping"' not in text


async def test_replicas_lists_each_replica(client, fake):
    from servelm.connectors.base import ReplicaStatus

    fake.replica_statuses = [
        ReplicaStatus(replica="a", state="RUNNING", node="10.0.0.1", pid=11, running=2, waiting=1, kv_cache_usage=0.5),
        ReplicaStatus(replica="b", state="UNRESPONSIVE", node="10.0.0.2", pid=12),
    ]
    r = await client.get("/v1/replicas")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and body["serving"] == 1
    assert [(d["replica"], d["state"], d["running"], d["waiting"], d["kv_cache_usage"]) for d in body["data"]] == [
        ("a", "RUNNING", 2, 1, 0.5),
        ("b", "UNRESPONSIVE", 0, 0, 0.0),
    ]


async def test_metrics_show_each_replica_and_the_sum(client, fake):
    from servelm.engine.outputs import EngineStats

    async def stats():
        return [
            EngineStats("fake-chat", num_running=3, prefix_cache_hits=30),
            EngineStats("fake-chat", num_running=1, prefix_cache_hits=10, replica="a"),
            EngineStats("fake-chat", num_running=2, prefix_cache_hits=20, replica="b"),
        ]

    fake.engine_stats = stats
    text = (await client.get("/metrics")).text
    assert 'servelm:num_requests_running{model_name="fake-chat"} 3.0' in text
    assert 'servelm:num_requests_running{model_name="fake-chat",replica="a"} 1.0' in text
    assert 'servelm:prefix_cache_hits_total{model_name="fake-chat",replica="b"} 20.0' in text
