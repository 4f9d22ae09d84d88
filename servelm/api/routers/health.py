"""Probes and operations: /health, /ping, /version, /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from servelm.api.errors import error_response
from servelm.api.metrics import CONTENT_TYPE_LATEST
from servelm.api.routers.common import app_state

router = APIRouter(tags=["operations"])


@router.get("/health", responses={503: {"description": "Models are still loading, or the engine is down."}})
async def health(request: Request) -> Response:
    """Readiness: 200 once every model is loaded and the engine runs, 503 before."""
    if await app_state(request).ctx.connector.health():
        return JSONResponse({"status": "ok"})
    return error_response(503, "Models are still loading, or the engine is down.", code="model_not_ready")


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
    """Prometheus metrics of this server."""
    return Response(app_state(request).ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)
