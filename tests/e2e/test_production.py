"""A real ``servelm serve`` under production conditions: metrics after a known
workload, overload against a bounded queue, a storm of disconnecting clients,
a SIGTERM drain with requests in flight, and an engine loop that dies.

All traffic goes to 127.0.0.1, bounded in count and time; only the server
processes started here are ever signalled.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import CHAT_MODEL, server_process

pytestmark = pytest.mark.model

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle on a stormy night."
TIMEOUT = 300.0  # a safety net per request; nothing here waits on a clock
# Every wait below ends on a state or an event; this only stops a hung test.
SAFETY_NET_S = 300.0


def scrape(http: httpx.Client) -> dict:
    r = http.get("/metrics")
    assert r.status_code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def sse_data(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def wait_idle(http: httpx.Client, within: float = SAFETY_NET_S) -> dict:
    """Poll /metrics until nothing runs, waits or holds KV blocks; fail after ``within`` seconds (a safety net)."""
    deadline = time.monotonic() + within
    while True:
        m = scrape(http)
        figures = [
            metric(m, f"servelm:{name}", model_name=CHAT_MODEL)
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        ]
        if figures == [0, 0, 0]:
            return m
        assert time.monotonic() < deadline, f"running, waiting, kv usage still {figures} after {within} s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def busy_server():
    with server_process(["--model", CHAT_MODEL, "--embedding-model", "none", "--max-waiting", "32"]) as server:
        yield server


@pytest.fixture(scope="module")
def http(busy_server):
    with httpx.Client(base_url=busy_server.url, timeout=TIMEOUT) as client:
        yield client


def test_metrics_equal_a_known_workload(http):
    before = scrape(http)
    usages = []
    for _ in range(3):  # the same prompt three times: the later ones hit the prefix cache
        r = http.post(
            "/v1/completions",
            json={"model": CHAT_MODEL, "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    for _ in range(2):
        r = http.post(
            "/v1/chat/completions",
            json={
                "model": CHAT_MODEL,
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 5,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert r.status_code == 200
        usages.append(sse_data(r.text)[-2]["usage"])
    after = wait_idle(http)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, model_name=CHAT_MODEL, **labels) - metric(
            before, name, model_name=CHAT_MODEL, **labels
        )

    requests, generated = 5, 5 * 5
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert all(u["completion_tokens"] == 5 for u in usages)
    assert cached > 0
    assert delta("servelm:request_success_total", finished_reason="length") == requests
    assert delta("servelm:generation_tokens_total") == generated
    assert delta("servelm:prompt_tokens_total") == prompt_tokens
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert delta(f"servelm:{name}_count") == requests, name
    # One token per engine step: 4 gaps in each request of 5 tokens.
    assert delta("servelm:inter_token_latency_seconds_count") == requests * 4
    assert delta("servelm:request_generation_tokens_sum") == generated
    assert delta("servelm:request_prompt_tokens_sum") == prompt_tokens
    # Every prompt token is looked up in the prefix cache once; the hits are what usage reports cached.
    assert delta("servelm:prefix_cache_queries_total") == prompt_tokens
    assert delta("servelm:prefix_cache_hits_total") == cached
    assert delta("servelm:num_preemptions_total") == 0

    # The HTTP counters are recorded once the response has ended, which the
    # server notes just after the client has read the last byte.
    def http_counts() -> list[float]:
        now = scrape(http)
        return [
            metric(now, "servelm:http_requests_total", method="POST", route=route, status="200")
            - metric(before, "servelm:http_requests_total", method="POST", route=route, status="200")
            for route in ("/v1/completions", "/v1/chat/completions")
        ]

    deadline = time.monotonic() + SAFETY_NET_S
    while http_counts() != [3, 2] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert http_counts() == [3, 2]


def test_a_request_that_can_never_fit_the_kv_cache_is_refused_up_front(http):
    # The e2e servers get a 256 MiB cache: fewer tokens than the 8192-token context.
    body = {"model": CHAT_MODEL, "prompt": PROMPT, "max_tokens": 7000, "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "can never fit in the KV cache" in error["message"]
    assert http.get("/health").status_code == 200


def test_overload_answers_every_request_with_a_stream_or_429(busy_server, http):
    n = 200

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str, httpx.Headers]:
        body = {"model": CHAT_MODEL, "prompt": f"{i}: {PROMPT}", "max_tokens": 32, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            return r.status_code, (await r.aread()).decode(), r.headers

    async def storm() -> list:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(base_url=busy_server.url, timeout=TIMEOUT, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)), return_exceptions=True)

    results = asyncio.run(storm())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} requests got no HTTP answer, e.g. {errors[0]!r}"
    streamed = refused = 0
    for status, text, headers in results:
        if status == 200:
            events = sse_data(text)
            assert events[-1] == "[DONE]"
            assert not any("error" in e for e in events[:-1] if isinstance(e, dict)), text
            tokens = sum(1 for e in events[:-1] if e["choices"] and e["choices"][0]["text"] is not None)
            assert events[-2]["choices"][0]["finish_reason"] == "length" and tokens >= 1
            streamed += 1
        else:
            assert status == 429, f"status {status}: {text}"
            assert int(headers["retry-after"]) >= 1
            assert json.loads(text)["error"]["code"] in ("queue_full", "queue_timeout")
            refused += 1
    assert streamed + refused == n
    assert streamed >= 32 and refused >= 1  # the bounded queue did refuse some
    assert http.get("/health").status_code == 200
    m = wait_idle(http)
    assert (
        metric(m, "servelm:admission_rejections_total", reason="queue_full")
        + metric(m, "servelm:admission_rejections_total", reason="queue_timeout")
        == refused
    )


def test_disconnect_storm_frees_every_sequence_and_block():
    with server_process(["--model", CHAT_MODEL, "--embedding-model", "none", "--max-waiting", "none"]) as server:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            _disconnect_storm(server.url, http)


def _disconnect_storm(url: str, http: httpx.Client) -> None:
    n = 100
    rng = random.Random(1234)
    leave_after = [rng.uniform(0.05, 4.0) for _ in range(n)]  # seconds: before the headers, or mid-stream

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": CHAT_MODEL, "prompt": f"{i}: {PROMPT}", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for _ in r.aiter_lines():
                pass
            return r.status_code

    async def storm() -> None:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT, limits=limits) as client:
            tasks = [asyncio.wait_for(one(client, i), leave_after[i]) for i in range(n)]
            results = await asyncio.gather(*tasks, return_exceptions=True)
        # Every client left on its own clock, none at the end of 2000 tokens.
        assert all(isinstance(r, TimeoutError) for r in results), [
            r for r in results if not isinstance(r, TimeoutError)
        ]

    before = scrape(http)
    asyncio.run(storm())
    m = wait_idle(http)

    # Freed because the clients left, not because the requests ran out: not one
    # of them reached its 2000 tokens, and every one the engine saw was aborted.
    # (The counts say so without a clock; a request whose client left before the
    # server read it never reached the engine.)
    def delta(name: str, **labels: str) -> float:
        return metric(m, name, model_name=CHAT_MODEL, **labels) - metric(before, name, model_name=CHAT_MODEL, **labels)

    aborted = delta("servelm:request_success_total", finished_reason="abort")
    assert delta("servelm:request_success_total", finished_reason="length") == 0
    assert 1 <= aborted <= n
    assert delta("servelm:generation_tokens_total") < aborted * 2000
    r = http.post("/v1/completions", json={"model": CHAT_MODEL, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def _stream_in_thread(
    url: str, body: dict, first_event: threading.Event, leave: threading.Event | None = None
) -> tuple[threading.Thread, list]:
    """Stream ``body`` in a thread, setting ``first_event`` at its first event; the client leaves once ``leave`` is set."""
    result: list = []

    def run() -> None:
        with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
            with client.stream("POST", "/v1/completions", json=body) as r:
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    if line.startswith("data: "):
                        first_event.set()
                    if leave is not None and leave.is_set():
                        break
                result.append((r.status_code, "\n".join(lines)))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_sigterm_drains_then_exits_0():
    """SIGTERM: new work is refused, streams in flight run to their end, then the server exits 0.

    Driven by events, not by the machine's speed: the drain timeout is only a
    safety net, two short streams finish on their own, and the long one holds
    the drain open until its client leaves. (A stream that outlives the drain
    timeout gets an error event; tests/api/test_lifecycle.py shows that on a
    held stream, which needs no clock either.)
    """
    args = ["--model", CHAT_MODEL, "--embedding-model", "none", "--shutdown-timeout", str(SAFETY_NET_S)]
    with server_process(args) as server:
        url = server.url
        short = {"model": CHAT_MODEL, "prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "stream": True}
        long = {**short, "max_tokens": 4000}
        started = [threading.Event() for _ in range(3)]
        leave_long = threading.Event()
        streams = [
            _stream_in_thread(url, short, started[0]),
            _stream_in_thread(url, short, started[1]),
            _stream_in_thread(url, long, started[2], leave_long),
        ]
        for ev in started:
            assert ev.wait(timeout=SAFETY_NET_S), server.stderr()

        server.proc.send_signal(signal.SIGTERM)
        # Still listening, but refusing new work.
        deadline = time.monotonic() + SAFETY_NET_S
        while httpx.get(url + "/ready", timeout=TIMEOUT).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = httpx.post(url + "/v1/completions", json={**short, "stream": False}, timeout=TIMEOUT)
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.json()["error"]["code"] == "server_shutting_down"

        for thread, _ in streams[:2]:  # the short streams finish during the drain
            thread.join(timeout=SAFETY_NET_S)
            assert not thread.is_alive()
        assert server.proc.poll() is None, "the server exited while a stream was still running"
        leave_long.set()  # the last request in flight goes: the drain is over
        assert server.proc.wait(timeout=SAFETY_NET_S) == 0, server.stderr()
        streams[2][0].join(timeout=SAFETY_NET_S)
        for _, result in streams[:2]:
            status, text = result[0]
            events = sse_data(text)
            assert status == 200 and events[-1] == "[DONE]"
            assert events[-2]["choices"][0]["finish_reason"] == "length"
        status, text = streams[2][1][0]
        assert status == 200 and not any("error" in e for e in sse_data(text) if isinstance(e, dict))


# Runs the real CLI after patching the engine so that a request asking for
# exactly 13 tokens crashes the engine loop itself (not just one step). Only
# the engine's public methods are wrapped, so its internals may change.
_CRASHING_ENGINE = """
import sys
from servelm import cli
from servelm.engine import llm_engine

real_add, real_step = llm_engine.LLMEngine.add_request, llm_engine.LLMEngine.step

def add_request(self, request_id, prompt, params, *args, **kwargs):
    if params.max_tokens == 13:
        self.crash_next_step = True
    return real_add(self, request_id, prompt, params, *args, **kwargs)

def step(self):
    if getattr(self, "crash_next_step", False):
        raise SystemError("injected: the engine loop crashed")
    return real_step(self)

llm_engine.LLMEngine.add_request = add_request
llm_engine.LLMEngine.step = step
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_dead_engine_loop_fails_its_requests_and_stops_the_server_with_status_1():
    args = ["--model", CHAT_MODEL, "--embedding-model", "none"]
    with server_process(args, python_args=("-c", _CRASHING_ENGINE)) as server:
        body = {"model": CHAT_MODEL, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT).status_code == 200
        r = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 13, "stream": True}, timeout=TIMEOUT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        assert server.proc.wait(timeout=SAFETY_NET_S) == 1
        assert "the engine loop died" in server.stderr()
