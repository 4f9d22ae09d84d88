"""``create_app(connector, settings)``: the FastAPI app, with no module-level state."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from servelm.api.auth import AuthMiddleware
from servelm.api.body_limit import BodyLimitMiddleware
from servelm.api.errors import CatchAllMiddleware, install_exception_handlers
from servelm.api.metrics import Metrics, MetricsMiddleware
from servelm.api.routers import chat, completions, embeddings, health, models, tokenize
from servelm.api.serving_engine import ServingContext, servelm_version
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

    ``settings`` supplies auth keys, CORS origins, the body limit and the
    chat template override (its file is read here, once). ``clock`` and
    ``new_id`` make response ids and timestamps reproducible in tests.
    Each app has its own metrics registry, so several apps can live in one
    process.
    """
    settings = settings if settings is not None else Settings()
    version = servelm_version()
    metrics = Metrics()
    ctx = ServingContext(
        connector=connector,
        metrics=metrics,
        chat_template=settings.read_chat_template(),
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
    routers = (chat, completions, embeddings, models, tokenize, health)
    for module in routers:
        app.include_router(module.router)

    # add_middleware wraps, so the last added runs first:
    # CORS -> metrics -> catch-all -> auth -> body limit -> routes.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    if settings.api_keys:
        app.add_middleware(AuthMiddleware, api_keys=settings.api_keys, metrics_require_auth=settings.metrics_require_auth)
    app.add_middleware(CatchAllMiddleware)
    routes = [r for r in app.routes if hasattr(r, "path")]
    routes += [r for module in routers for r in module.router.routes]
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=routes)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    return app
