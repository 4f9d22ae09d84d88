"""/metrics after a known workload: every counter and histogram count equals what was sent."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from servelm.engine.outputs import EngineStats

from .conftest import make_app, make_client
from .fake_connector import QUEUE_TIME, FakeConnector, encode

MODEL = "fake-chat"
REPLY_TOKENS = len(encode("Hello world", add_special_tokens=False))  # the fake's reply, one token per byte


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text page, keyed by name and sorted labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_counters_and_histograms_equal_a_known_workload(fake):
    app = make_app(fake)
    prompt_tokens = 0
    async with make_client(app) as c:
        for _ in range(3):  # cut short by max_tokens: finish_reason length, 4 tokens each
            r = await c.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            )
            assert r.status_code == 200
            prompt_tokens += r.json()["usage"]["prompt_tokens"]
        for _ in range(2):  # streamed to the end of the reply: finish_reason stop
            r = await c.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "abc", "stream": True, "stream_options": {"include_usage": True}},
            )
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            prompt_tokens += len(encode("abc"))
        # Two prompts in one request: two engine requests of 3 tokens each.
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "bb"], "max_tokens": 3})
        assert r.status_code == 200
        prompt_tokens += r.json()["usage"]["prompt_tokens"]
        # Refused requests never reach the request metrics.
        assert (await c.post("/v1/completions", json={"model": "nope", "prompt": "a"})).status_code == 404
        assert (
            await c.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 999})
        ).status_code == 400
        text = (await c.get("/metrics")).text

    m = parse(text)
    requests = 3 + 2 + 2
    generated = 3 * 4 + 2 * REPLY_TOKENS + 2 * 3
    assert value(m, "servelm:request_success_total", model_name=MODEL, finished_reason="length") == 3 + 2
    assert value(m, "servelm:request_success_total", model_name=MODEL, finished_reason="stop") == 2
    assert value(m, "servelm:generation_tokens_total", model_name=MODEL) == generated
    assert value(m, "servelm:prompt_tokens_total", model_name=MODEL) == prompt_tokens
    # The fake emits one token per output: every output after the first is one inter-token gap.
    assert value(m, "servelm:inter_token_latency_seconds_count", model_name=MODEL) == generated - requests
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert value(m, f"servelm:{name}_count", model_name=MODEL) == requests, name
    assert value(m, "servelm:request_queue_time_seconds_sum", model_name=MODEL) == pytest.approx(requests * QUEUE_TIME)
    assert value(m, "servelm:request_prompt_tokens_sum", model_name=MODEL) == prompt_tokens
    assert value(m, "servelm:request_generation_tokens_sum", model_name=MODEL) == generated
    # A first token comes no later than the last: TTFT sums to at most the end-to-end sum.
    assert value(m, "servelm:time_to_first_token_seconds_sum", model_name=MODEL) <= value(
        m, "servelm:e2e_request_latency_seconds_sum", model_name=MODEL
    )
    http = "servelm:http_requests_total"
    assert value(m, http, method="POST", route="/v1/chat/completions", status="200") == 3
    assert value(m, http, method="POST", route="/v1/completions", status="200") == 3
    assert value(m, http, method="POST", route="/v1/completions", status="404") == 1
    assert value(m, http, method="POST", route="/v1/completions", status="400") == 1
    assert value(m, "servelm:http_request_duration_seconds_count", method="POST", route="/v1/completions") == 5


async def test_engine_figures_come_from_the_connector_at_each_scrape():
    class Busy(FakeConnector):
        async def engine_stats(self):
            return [
                EngineStats(
                    MODEL,
                    num_running=3,
                    num_waiting=5,
                    kv_cache_usage=0.25,
                    prefix_cache_queries=640,
                    prefix_cache_hits=128,
                    num_preemptions=2,
                    spec_decode_drafts=7,
                    spec_decode_draft_tokens=28,
                    spec_decode_accepted_tokens=19,
                )
            ]

    fake = Busy()
    async with make_client(make_app(fake)) as c:
        m = parse((await c.get("/metrics")).text)
    assert value(m, "servelm:num_requests_running", model_name=MODEL) == 3
    assert value(m, "servelm:num_requests_waiting", model_name=MODEL) == 5
    assert value(m, "servelm:kv_cache_usage_perc", model_name=MODEL) == 0.25
    assert value(m, "servelm:prefix_cache_queries_total", model_name=MODEL) == 640
    assert value(m, "servelm:prefix_cache_hits_total", model_name=MODEL) == 128
    assert value(m, "servelm:num_preemptions_total", model_name=MODEL) == 2
    assert value(m, "servelm:spec_decode_num_drafts_total", model_name=MODEL) == 7
    assert value(m, "servelm:spec_decode_num_draft_tokens_total", model_name=MODEL) == 28
    assert value(m, "servelm:spec_decode_num_accepted_tokens_total", model_name=MODEL) == 19


async def test_admission_rejections_are_counted(fake):
    fake.waiting = 4
    app = make_app(fake, max_waiting=4)
    async with make_client(app) as c:
        for _ in range(2):
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "a"})
            assert r.status_code == 429
        m = parse((await c.get("/metrics")).text)
    assert value(m, "servelm:admission_rejections_total", reason="queue_full") == 2
    assert value(m, "servelm:http_requests_total", method="POST", route="/v1/completions", status="429") == 2


async def test_engine_errors_count_as_error(fake):
    fake.error_after = 1
    app = make_app(fake)
    async with make_client(app) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "a"})
        assert r.status_code == 500
        m = parse((await c.get("/metrics")).text)
    assert value(m, "servelm:request_success_total", model_name=MODEL, finished_reason="error") == 1
    assert value(m, "servelm:e2e_request_latency_seconds_count", model_name=MODEL) == 0
