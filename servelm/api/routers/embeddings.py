"""POST /v1/embeddings."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from servelm.api.protocol import EmbeddingRequest
from servelm.api.responses import EmbeddingResponse
from servelm.api.routers.common import ERRORS, app_state

router = APIRouter(tags=["embeddings"], strict_content_type=False)


@router.post("/v1/embeddings", response_model=None, responses={200: {"model": EmbeddingResponse}, **ERRORS})
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    """Embed one or more inputs (OpenAI-compatible)."""
    return await app_state(request).embedding.create(body, request)
