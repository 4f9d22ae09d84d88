"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from servelm.api.protocol import ChatCompletionRequest
from servelm.api.responses import ChatCompletionResponse
from servelm.api.routers.common import ERRORS, app_state

router = APIRouter(tags=["chat"], strict_content_type=False)


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses={
        200: {
            "model": ChatCompletionResponse,
            "description": "A chat completion, or with `stream: true` a `text/event-stream` of "
            "`chat.completion.chunk` events ending with `data: [DONE]`.",
            "content": {"text/event-stream": {}},
        },
        **ERRORS,
    },
)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    """Create a chat completion (OpenAI-compatible)."""
    return await app_state(request).chat.create(body, request)
