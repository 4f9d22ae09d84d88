"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from servelm.api.protocol import CompletionRequest
from servelm.api.responses import CompletionResponse
from servelm.api.routers.common import ERRORS, app_state

router = APIRouter(tags=["completions"], strict_content_type=False)


@router.post(
    "/v1/completions",
    response_model=None,
    responses={
        200: {
            "model": CompletionResponse,
            "description": "A text completion, or with `stream: true` a `text/event-stream` of "
            "`text_completion` events ending with `data: [DONE]`.",
            "content": {"text/event-stream": {}},
        },
        **ERRORS,
    },
)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    """Create a text completion (OpenAI's legacy completions API)."""
    return await app_state(request).completion.create(body, request)
