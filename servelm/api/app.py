"""``create_app(connector, settings)``: the FastAPI app, with no module-level state."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from types import ModuleType

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from servelm.api.access_log import REQUEST_ID_HEADER, AccessLogMiddleware
from servelm.api.admission import Admission
from servelm.api.auth import AuthMiddleware
from servelm.api.body_limit import BodyLimitMiddleware
from servelm.api.errors import CatchAllMiddleware, install_exception_handlers
from servelm.api.metrics import Metrics, MetricsMiddleware
from servelm.api.ratelimit import REQUESTS, TOKENS, RateLimiter, RateLimitMiddleware
from servelm.api.routers import chat, completions, embeddings, health, models, tokenize, web
from servelm.api.serving_base import ServingContext, servelm_version
from servelm.api.state import AppState
from servelm.connectors.base import Connector
from servelm.settings import Settings


def create_app(
    connector: Connector,
    settings: Settings | None = None,
    *,
    clock: Callable[[], float] = time.time,
    new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
) -> FastAPI:
    """Build the OpenAI-compatible app serving ``connector``.

    ``settings`` supplies auth keys, rate limits, admission control
    (max_waiting, queue_timeout, request_timeout), CORS origins, the body
    limit and the chat template override (its file is read here, once).
    ``clock`` (wall time: response timestamps and, with ``memory://``
    storage, rate-limit windows) and ``new_id`` (request and response ids)
    make responses reproducible in tests. Each app has its own metrics
    registry and rate-limit counters, so several apps can live in one
    process.
    """
    settings = settings if settings is not None else Settings()
    version = servelm_version()
    metrics = Metrics()
    ctx = ServingContext(
        connector=connector,
        metrics=metrics,
        admission=Admission(
            max_waiting=settings.max_waiting,
            queue_timeout=settings.queue_timeout,
            request_timeout=settings.request_timeout,
        ),
        chat_template=settings.read_chat_template(),
        tool_call_parser=settings.tool_call_parser,
        clock=clock,
        new_id=new_id,
        version=version,
    )
    app = FastAPI(
        title="servelm",
        version=version,
        description="An OpenAI-compatible LLM inference server. See docs/API.md for what each field does.",
    )
    app.state.servelm = AppState.build(ctx)
    install_exception_handlers(app)
    routers: tuple[ModuleType, ...] = (chat, completions, embeddings, models, tokenize, health)
    if settings.web:
        routers += (web,)
    for module in routers:
        app.include_router(module.router)
    if settings.web:
        app.mount("/static", web.static_files(), name="static")

    # add_middleware wraps, so the last added runs first: CORS -> access log ->
    # metrics -> catch-all -> auth -> rate limit -> body limit -> routes.
    # Rate limiting runs after auth, so only valid keys get counters, and
    # before the body is read, so a refused request costs nothing more.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    if settings.rate_limits.enabled:
        limiter = RateLimiter.from_uri(settings.rate_limits, settings.rate_limit_storage, clock=clock, metrics=metrics)
        app.add_middleware(RateLimitMiddleware, limiter=limiter, keyed=bool(settings.api_keys))
    if settings.api_keys:
        app.add_middleware(
            AuthMiddleware,
            api_keys=settings.api_keys,
            metrics_require_auth=settings.metrics_require_auth,
            public_paths=web.PUBLIC_PATHS if settings.web else (),
            public_prefix=web.PUBLIC_PREFIX if settings.web else None,
        )
    app.add_middleware(CatchAllMiddleware)
    routes = [r for r in app.routes if hasattr(r, "path")]
    routes += [r for module in routers for r in module.router.routes]
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=routes)
    app.add_middleware(AccessLogMiddleware, new_id=new_id, routes=routes)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            # Browsers hide response headers from scripts unless listed here.
            expose_headers=[REQUEST_ID_HEADER, "retry-after", *_rate_limit_headers()],
        )
    return app


def _rate_limit_headers() -> list[str]:
    return [f"x-ratelimit-{what}-{kind}" for kind in (REQUESTS, TOKENS) for what in ("limit", "remaining", "reset")]
