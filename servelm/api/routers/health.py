"""Probes and operations: /health, /ready, /ping, /version, /metrics."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from servelm.api.errors import ServerShuttingDown
from servelm.api.metrics import CONTENT_TYPE_LATEST
from servelm.api.routers.common import app_state
from servelm.api.serving_base import not_ready_error

router = APIRouter(tags=["operations"])

_NOT_READY: dict[int | str, dict[str, Any]] = {503: {"description": "Models are still loading, or the engine is down."}}


async def _require_healthy(request: Request) -> None:
    connector = app_state(request).ctx.connector
    if not await connector.health():
        raise await not_ready_error(connector)


@router.get("/health", responses=_NOT_READY)
async def health(request: Request) -> Response:
    """200 once every model is loaded and the engine runs; 503 while loading (``model_not_ready``)
    or once the engine loop has died (``engine_dead``; the server then exits). Draining does not change it."""
    await _require_healthy(request)
    return JSONResponse({"status": "ok"})


@router.get("/ready", responses={503: {"description": "Loading, draining for shutdown, or the engine is down."}})
async def ready(request: Request) -> Response:
    """Readiness for traffic: like /health, and also 503 ``server_shutting_down`` while the server drains."""
    if app_state(request).ctx.lifecycle.draining:
        raise ServerShuttingDown()
    await _require_healthy(request)
    return JSONResponse({"status": "ready"})


@router.get("/ping")
async def ping() -> dict[str, str]:
    """Liveness: 200 whenever the process answers HTTP."""
    return {"status": "ok"}


@router.get("/version")
async def version(request: Request) -> dict[str, str]:
    """The servelm version."""
    return {"version": app_state(request).ctx.version}


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(request: Request) -> Response:
    """Prometheus metrics of this server, the engines' current figures included."""
    ctx = app_state(request).ctx
    ctx.metrics.update_engine(await ctx.connector.engine_stats())
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/replicas")
async def replicas(request: Request) -> dict[str, Any]:
    """The engine replicas serving this server: one (``local``) in process, each Ray Serve replica
    otherwise, with its state (RUNNING, DEAD, UNRESPONSIVE), node, pid, running and waiting requests
    and KV cache usage."""
    connector = app_state(request).ctx.connector
    rows = [asdict(r) for r in await connector.replicas()]
    return {"object": "list", "data": rows, "serving": sum(r["state"] == "RUNNING" for r in rows)}
