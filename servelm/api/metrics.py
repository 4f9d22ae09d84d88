"""Prometheus metrics of one app, in a registry of its own (no global state)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["CONTENT_TYPE_LATEST", "Metrics", "MetricsMiddleware", "route_label"]


class Metrics:
    """The counters the API keeps; ``render()`` gives the Prometheus text format."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "servelm_http_requests",
            "HTTP requests by route template, method and status code.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "servelm_http_request_duration_seconds",
            "Time from request to the end of the response body (streams included).",
            ["method", "route"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "servelm_prompt_tokens", "Prompt tokens processed.", ["model"], registry=self.registry
        )
        self.generation_tokens = Counter(
            "servelm_generation_tokens", "Tokens generated.", ["model"], registry=self.registry
        )
        self.running = Gauge(
            "servelm_generation_requests_running",
            "Generation requests in flight through the API.",
            ["model"],
            registry=self.registry,
        )
        # vLLM's `vllm:` naming; the other metrics move to `servelm:` with the engine's.
        self.rate_limit_rejections = Counter(
            "servelm:rate_limit_rejections",
            "Requests refused with 429 by the rate limiter, by the limit they hit (requests or tokens).",
            ["kind"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format."""
        return generate_latest(self.registry)


def route_label(scope: Scope, routes: Sequence[BaseRoute]) -> str:
    """The route template a request was for (``/v1/models/{model_id:path}``), or ``unmatched``."""
    route = scope.get("route")
    if route is not None and hasattr(route, "path"):
        return route.path
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
            self.metrics.requests.labels(method, route, str(status)).inc()
            self.metrics.latency.labels(method, route).observe(time.perf_counter() - start)
