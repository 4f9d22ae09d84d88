"""POST /tokenize and /detokenize (also under /v1/), as vLLM serves them."""

from __future__ import annotations

from fastapi import APIRouter, Request

from servelm.api.protocol import DetokenizeRequest, TokenizeRequest
from servelm.api.responses import DetokenizeResponse, TokenizeResponse
from servelm.api.routers.common import ERRORS, app_state

router = APIRouter(tags=["tokenize"], strict_content_type=False)


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
@router.post("/v1/tokenize", response_model=TokenizeResponse, responses=ERRORS, include_in_schema=False)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """Token ids of a prompt, or of chat messages rendered with the chat template."""
    return await app_state(request).tokenize.tokenize(body)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
@router.post("/v1/detokenize", response_model=DetokenizeResponse, responses=ERRORS, include_in_schema=False)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """Text of a list of token ids."""
    return await app_state(request).tokenize.detokenize(body)
