"""servelm on a real Ray cluster (two nodes on this machine, two engine replicas).

Every wait is on a state (replicas reporting, counters reaching a value),
never on a sleep or a time; traffic goes to 127.0.0.1 only and is bounded.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from servelm.connectors.ray_cluster import LOOPBACK_ENV

from .conftest import MODEL, wait_for

pytestmark = pytest.mark.model

TIMEOUT = 120.0


def _metrics(url: str) -> dict[tuple[str, str], float]:
    """(sample name, replica label or "") -> value for the servelm engine figures."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("servelm:") and "model_name" in s.labels:
                out[(s.name, s.labels.get("replica", ""))] = s.value
    return out


def _replicas(url: str) -> dict:
    return httpx.get(url + "/v1/replicas", timeout=30).json()


def _chat(http: httpx.Client, messages, **kw) -> dict:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def _stream_text(url: str, body: dict, on_event=None) -> tuple[str, str | None, list[dict]]:
    """Stream a chat completion; returns (text, finish_reason, error events)."""
    text, finish, errors = "", None, []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                errors.append(event)
                continue
            for choice in event["choices"]:
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
            if on_event is not None:
                on_event()
    return text, finish, errors


def test_replicas_on_both_nodes_serve(ray_deployment):
    url = ray_deployment.url
    running = [r for r in _replicas(url)["data"] if r["state"] == "RUNNING"]
    assert len(running) == 2
    assert len({r["node_id"] for r in running}) == 2  # one replica per node
    for replica in running:  # both "nodes" run on this machine
        environ = Path(f"/proc/{replica['pid']}/environ").read_bytes().split(b"\0")
        assert b"MALLOC_ARENA_MAX=1" in environ  # one malloc arena from the start (servelm/platform/arena.py)
    before = _metrics(url)
    bodies = [
        {"messages": [{"role": "user", "content": f"Count from {i} to {i + 5}."}], "max_tokens": 4, "temperature": 0}
        for i in range(8)
    ]
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http, ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda b: _chat(http, **b), bodies))
    assert all(r["usage"]["completion_tokens"] >= 1 for r in replies)

    def both_served():
        now = _metrics(url)
        served = {
            rep
            for (name, rep), v in now.items()
            if name == "servelm:prefix_cache_queries_total" and rep and v > before.get((name, rep), 0.0)
        }
        return served if len(served) == 2 else None

    # Concurrent requests spread over both replicas (power of two choices on load).
    wait_for(both_served, 60, "both replicas to have served requests")
    assert _chat(httpx.Client(base_url=url, timeout=TIMEOUT), [{"role": "user", "content": "Hi"}], max_tokens=2)


def _system_prompt(i: int) -> str:
    rules = " ".join(f"Rule {k}: always answer questions about topic {k * 7 + i} politely." for k in range(7))
    return f"You are assistant number {i}. {rules}"


def _prefix_phase(url: str, prompts: list[str]) -> float:
    """8 system prompts x 16 users through the deployment; returns the prefix-cache hit rate of the phase.

    Load-only routing sends each request to a replica at random, so its hit
    rate varies from run to run: with 8 users 0.16-0.33 in eight runs,
    against 0.63 prefix-aware, and one run in about ten fell short of 1.8x;
    with 16, 0.19-0.30 against 0.68 in five runs.
    """
    before = _metrics(url)
    # Users come in a shuffled order each round: in a fixed cycle of eight, a
    # balancer that alternates between two replicas would pin each prompt to
    # one replica by accident.
    rng = random.Random(17)
    jobs = [
        [{"role": "system", "content": prompts[i]}, {"role": "user", "content": f"User {j} asks: what is {j} + {i}?"}]
        for j in range(16)
        for i in rng.sample(range(8), 8)
    ]
    # One at a time: a replica's small KV cache then holds its share of the
    # prompts (about four) and nothing else, the same in every run.
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        replies = [_chat(http, m, max_tokens=1, temperature=0) for m in jobs]
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in replies)
    queries_key, hits_key = ("servelm:prefix_cache_queries_total", ""), ("servelm:prefix_cache_hits_total", "")

    def reported():
        now = _metrics(url)
        if now[queries_key] - before.get(queries_key, 0.0) >= prompt_tokens:
            return now
        return None

    now = wait_for(reported, 60, "the replicas to report the phase's prefix-cache lookups")
    queries = now[queries_key] - before.get(queries_key, 0.0)
    hits = now[hits_key] - before.get(hits_key, 0.0)
    return hits / queries


def test_prefix_routing_raises_the_prefix_cache_hit_rate(ray_deployment):
    url, connector = ray_deployment.url, ray_deployment.connector
    # Two phases on the same replicas, each with system prompts of its own, so
    # neither finds the other's prompts cached.
    connector.prefix_routing = False
    try:
        load_only = _prefix_phase(url, [_system_prompt(i) for i in range(8)])
    finally:
        connector.prefix_routing = True
    prefix_aware = _prefix_phase(url, [_system_prompt(i + 100) for i in range(8)])
    assert prefix_aware > 0
    assert prefix_aware >= 1.8 * load_only, (prefix_aware, load_only)


def _totals(url: str) -> tuple[float, float]:
    m = _metrics(url)
    return m[("servelm:num_requests_running", "")], m[("servelm:kv_cache_usage_perc", "")]


def test_disconnected_streams_free_every_replica(ray_deployment):
    url = ray_deployment.url
    body = {
        "model": MODEL,
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    def open_and_leave(i: int) -> int:
        events = 0
        messages = [{"role": "user", "content": f"Write a long essay about the number {i}."}]
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json={**body, "messages": messages}, timeout=TIMEOUT
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events += 1
                if events == 3:  # the role, then two pieces of text: mid-way
                    break
        return events  # leaving the block closed the connection

    with ThreadPoolExecutor(20) as pool:
        assert list(pool.map(open_and_leave, range(20))) == [3] * 20
    # Every replica aborts its requests and frees their KV blocks.
    wait_for(lambda: _totals(url) == (0.0, 0.0), 90, "running requests and KV usage to return to 0")
    rows = _replicas(url)["data"]
    assert all(r["running"] == 0 and r["kv_cache_usage"] == 0.0 for r in rows if r["state"] == "RUNNING")


def test_a_killed_replica_loses_no_stream_and_comes_back(ray_deployment, caplog):
    url = ray_deployment.url
    bodies = [
        {
            "model": MODEL,
            "temperature": 0,
            "max_tokens": 24,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Tell me a story about a cat named {name}."}],
        }
        for name in [
            "Tom",
            "Ada",
            "Max",
            "Kit",
            "Sam",
            "Leo",
            "Zoe",
            "Ivy",
            "Ben",
            "Eva",
            "Jim",
            "Una",
            "Ray",
            "Pam",
            "Ned",
            "Oli",
            "Gus",
            "Fay",
            "Hal",
            "Dot",
        ]
    ]
    with ThreadPoolExecutor(20) as pool:
        healthy = list(pool.map(lambda b: _stream_text(url, b), bodies))
    assert all(finish == "length" and not errors for _, finish, errors in healthy)

    first_events = []
    victim: dict = {}

    def kill_when_busy():
        # Once every stream has text, SIGKILL the replica serving the most of them.
        rows = [r for r in _replicas(url)["data"] if r["state"] == "RUNNING"]
        target = max(rows, key=lambda r: r["running"])
        if target["running"] == 0:
            return False
        os.kill(target["pid"], signal.SIGKILL)
        victim.update(target)
        return True

    def run(body):
        return _stream_text(url, body, on_event=lambda: first_events.append(1))

    # The front end runs in this process: its log says which streams it resumed.
    caplog.set_level(logging.WARNING, logger="servelm.connectors.ray_resume")
    with ThreadPoolExecutor(20) as pool:
        futures = [pool.submit(run, b) for b in bodies]
        wait_for(lambda: len(first_events) >= 40 or all(f.done() for f in futures), TIMEOUT, "streams to start")
        assert not all(f.done() for f in futures), "every stream ended before the kill"
        wait_for(kill_when_busy, 30, "a replica with running requests to kill")
        results = [f.result(timeout=TIMEOUT) for f in futures]

    for (text, finish, errors), (ref_text, _, _) in zip(results, healthy, strict=True):
        assert not errors
        assert finish == "length"
        assert text == ref_text  # the same text as on a healthy deployment: nothing lost or repeated
    # The kill cut streams mid-way (not after they ended): those were resumed on the other replica.
    resumed = [r for r in caplog.records if "resuming on another replica" in r.getMessage()]
    assert resumed, "no stream was running on the killed replica"

    def back():
        rows = _replicas(url)["data"]
        running = [r for r in rows if r["state"] == "RUNNING"]
        return len(running) == 2 and victim["pid"] not in {r["pid"] for r in running}

    wait_for(back, 180, "Serve to restart the killed replica")


def test_replicas_that_cannot_be_placed_fail_at_start(ray_deployment, tmp_path):
    # A replica wanting more CPUs than any node has: a clear error and exit, not a wait.
    cmd = [
        sys.executable,
        "-m",
        "servelm",
        "serve",
        "--port",
        "0",
        "--embedding-model",
        "none",
        "--ray-address",
        ray_deployment.address,
        "--replicas",
        "1",
        "--replica-cpus",
        "4",
        "--ray-app-name",
        "servelm-unplaceable",
    ]
    # Nothing of the fixture's Ray environment either: joining a loopback address keeps loopback by itself.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVELM_") and k != LOOPBACK_ENV}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, check=False)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "largest node of the cluster has 1" in result.stderr
