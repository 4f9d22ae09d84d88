"""Prometheus metrics of one app, in a registry of its own (no global state)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servelm.api.disconnects import logged_status
from servelm.engine.outputs import EngineStats

__all__ = ["CONTENT_TYPE_LATEST", "EngineCollector", "Metrics", "MetricsMiddleware", "RequestRecorder", "route_label"]


# Histogram buckets as vLLM's dashboards expect them (seconds and token counts).
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

_MODEL = ["model_name"]


class Metrics:
    """The metrics of one app, under vLLM's names with the ``servelm:`` prefix.

    Request-level figures are recorded by the API as outputs stream
    (:class:`RequestRecorder`); the engine's gauges and running totals are
    read from the connector at each scrape (:meth:`update_engine`).
    ``render()`` gives the Prometheus text format.
    """

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.http_requests = Counter(
            "servelm:http_requests",
            "HTTP requests by route template, method and status code.",
            ["method", "route", "status"],
            registry=r,
        )
        self.http_latency = Histogram(
            "servelm:http_request_duration_seconds",
            "Time from request to the end of the response body (streams included).",
            ["method", "route"],
            registry=r,
        )
        self.prompt_tokens = Counter("servelm:prompt_tokens", "Prompt tokens of admitted requests.", _MODEL, registry=r)
        self.generation_tokens = Counter("servelm:generation_tokens", "Tokens generated.", _MODEL, registry=r)
        self.request_success = Counter(
            "servelm:request_success",
            "Engine requests ended, by finish reason (stop, length; abort when the client left or the "
            "request timed out; error when the engine failed it).",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "servelm:time_to_first_token_seconds",
            "From the API receiving a request to its first token.",
            _MODEL,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "servelm:inter_token_latency_seconds",
            "Time between a request's consecutive outputs.",
            _MODEL,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "servelm:e2e_request_latency_seconds",
            "From the API receiving a request to its last token.",
            _MODEL,
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "servelm:request_queue_time_seconds",
            "Time a request waited in the engine before it was first scheduled.",
            _MODEL,
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.request_prompt_tokens = Histogram(
            "servelm:request_prompt_tokens",
            "Prompt tokens per finished request.",
            _MODEL,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "servelm:request_generation_tokens",
            "Generated tokens per finished request.",
            _MODEL,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.rate_limit_rejections = Counter(
            "servelm:rate_limit_rejections",
            "Requests refused with 429 by the rate limiter, by the limit they hit (requests or tokens).",
            ["kind"],
            registry=r,
        )
        self.admission_rejections = Counter(
            "servelm:admission_rejections",
            "Requests refused by admission control: 429 queue_full or queue_timeout, 503 server_shutting_down.",
            ["reason"],
            registry=r,
        )
        started = time.monotonic()
        self.uptime = Gauge("servelm:uptime_seconds", "Seconds since the server's app was built.", registry=r)
        self.uptime.set_function(lambda: time.monotonic() - started)
        self.engine = EngineCollector()
        r.register(self.engine)

    def update_engine(self, stats: Sequence[EngineStats]) -> None:
        """Take the engines' latest snapshot (before a scrape)."""
        self.engine.stats = list(stats)

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format."""
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """The engines' gauges and totals, from the last :class:`EngineStats` snapshot.

    The totals are the engine's own running counts, exported as counters
    (a counter that restarts with the engine, as Prometheus expects). On
    Ray, each replica's figures come with a ``replica`` label beside the
    deployment's sum, which has none: ``{replica=""}`` selects the sum.
    """

    def __init__(self) -> None:
        self.stats: list[EngineStats] = []

    def describe(self) -> list[Metric]:
        return []  # families are only known at collect time; keeps registration cheap

    def collect(self) -> Iterator[Metric]:
        families = {
            "num_requests_running": GaugeMetricFamily(
                "servelm:num_requests_running", "Sequences running in the engine (holding KV blocks).", labels=_MODEL
            ),
            "num_requests_waiting": GaugeMetricFamily(
                "servelm:num_requests_waiting", "Sequences waiting to be scheduled (new or preempted).", labels=_MODEL
            ),
            "kv_cache_usage_perc": GaugeMetricFamily(
                "servelm:kv_cache_usage_perc",
                "Fraction of KV cache blocks held by sequences (1 = full); free prefix-cached blocks do not count.",
                labels=_MODEL,
            ),
            "prefix_cache_queries": CounterMetricFamily(
                "servelm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels=_MODEL
            ),
            "prefix_cache_hits": CounterMetricFamily(
                "servelm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels=_MODEL
            ),
            "num_preemptions": CounterMetricFamily(
                "servelm:num_preemptions",
                "Sequences preempted (their KV blocks freed, recomputed later).",
                labels=_MODEL,
            ),
            "spec_decode_num_drafts": CounterMetricFamily(
                "servelm:spec_decode_num_drafts",
                "Speculative proposals verified (one per sequence and step).",
                labels=_MODEL,
            ),
            "spec_decode_num_draft_tokens": CounterMetricFamily(
                "servelm:spec_decode_num_draft_tokens",
                "Tokens proposed by speculative decoding and verified.",
                labels=_MODEL,
            ),
            "spec_decode_num_accepted_tokens": CounterMetricFamily(
                "servelm:spec_decode_num_accepted_tokens",
                "Of the proposed tokens, those the target model accepted (acceptance rate: accepted / draft tokens).",
                labels=_MODEL,
            ),
            "model_info": GaugeMetricFamily(
                "servelm:model_info",
                "Always 1; its labels say how the model runs (dtype, device).",
                labels=["model_name", "dtype", "device"],
            ),
            "kv_cache_size_tokens": GaugeMetricFamily(
                "servelm:kv_cache_size_tokens",
                "Tokens the KV cache holds in all (blocks times block size).",
                labels=_MODEL,
            ),
            "kv_cache_size_bytes": GaugeMetricFamily(
                "servelm:kv_cache_size_bytes", "Memory the KV cache takes.", labels=_MODEL
            ),
        }
        for s in self.stats:
            # A replica's own figures carry a `replica` label; the series
            # without one is this process's engine, or the sum over replicas.
            labels = {"model_name": s.model} if s.replica is None else {"model_name": s.model, "replica": s.replica}
            values = {
                "num_requests_running": s.num_running,
                "num_requests_waiting": s.num_waiting,
                "kv_cache_usage_perc": s.kv_cache_usage,
                "prefix_cache_queries": s.prefix_cache_queries,
                "prefix_cache_hits": s.prefix_cache_hits,
                "num_preemptions": s.num_preemptions,
                "spec_decode_num_drafts": s.spec_decode_drafts,
                "spec_decode_num_draft_tokens": s.spec_decode_draft_tokens,
                "spec_decode_num_accepted_tokens": s.spec_decode_accepted_tokens,
                "kv_cache_size_tokens": s.kv_cache_tokens,
                "kv_cache_size_bytes": s.kv_cache_bytes,
            }
            for key, value in values.items():
                family = families[key]
                suffix = "_total" if isinstance(family, CounterMetricFamily) else ""
                family.add_sample(family.name + suffix, labels, value)
            families["model_info"].add_sample("servelm:model_info", {**labels, "dtype": s.dtype, "device": s.device}, 1)
        yield from families.values()


class RequestRecorder:
    """Records one engine request's metrics as its outputs arrive.

    ``started`` is when the API received the request (``time.perf_counter``).
    Call :meth:`output` for each output and :meth:`end` once (later calls are
    ignored), with the finish reason, ``abort`` or ``error``.
    """

    def __init__(self, metrics: Metrics, model: str, prompt_tokens: int, started: float):
        self.metrics = metrics
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.started = started
        self.last_token: float | None = None  # time of the latest token, None before the first
        self.generated = 0
        self.finish_reason: str | None = None
        self.ended = False
        self._queue_time_seen = False

    def output(self, new_tokens: int, queue_time: float | None, finish_reason: str | None) -> None:
        m, model = self.metrics, self.model
        if queue_time is not None and not self._queue_time_seen:
            self._queue_time_seen = True
            m.queue_time.labels(model).observe(queue_time)
        if finish_reason is not None:
            self.finish_reason = finish_reason
        if not new_tokens:
            return
        now = time.perf_counter()
        if self.last_token is None:
            m.ttft.labels(model).observe(now - self.started)
        else:
            m.itl.labels(model).observe(now - self.last_token)
        self.last_token = now
        self.generated += new_tokens
        m.generation_tokens.labels(model).inc(new_tokens)

    def end(self, reason: str | None = None) -> None:
        """The request is over: ``reason`` None means it finished normally (its own finish reason counts)."""
        if self.ended:
            return
        self.ended = True
        m, model = self.metrics, self.model
        m.request_success.labels(model, reason or self.finish_reason or "stop").inc()
        if reason is None:
            m.e2e.labels(model).observe((self.last_token or time.perf_counter()) - self.started)
            m.request_prompt_tokens.labels(model).observe(self.prompt_tokens)
            m.request_generation_tokens.labels(model).observe(self.generated)


def route_label(scope: Scope, routes: Sequence[BaseRoute]) -> str:
    """The route template a request was for (``/v1/models/{model_id:path}``), or ``unmatched``."""
    route = scope.get("route")
    if route is not None and hasattr(route, "path"):
        return str(route.path)
    # Requests stopped before routing (401, 413, 429): find the route they were
    # for, so labels stay bounded by the route table, never the raw path.
    for candidate in routes:
        match, _ = candidate.matches(scope)
        if match != Match.NONE:
            return getattr(candidate, "path", "unmatched")
    return "unmatched"


class MetricsMiddleware:
    """Counts every HTTP request by route template and final status, and times it.

    A pure ASGI middleware, so streamed responses are timed to their last
    byte and rejected requests (401, 413, 404) are counted too.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: Sequence[BaseRoute] = ()):
        self.app = app
        self.metrics = metrics
        self.routes = routes  # the app's routes, to label requests that never reached one

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        start = time.perf_counter()

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = route_label(scope, self.routes)
            method = scope.get("method", "")
            self.metrics.http_requests.labels(method, route, str(logged_status(scope, status))).inc()
            self.metrics.http_latency.labels(method, route).observe(time.perf_counter() - start)
