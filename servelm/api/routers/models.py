"""GET /v1/models and /v1/models/{model_id}."""

from __future__ import annotations

from fastapi import APIRouter, Request

from servelm.api.responses import ModelList, ModelObject
from servelm.api.routers.common import ERRORS, app_state
from servelm.connectors.base import ModelCard, ModelNotFound

router = APIRouter(tags=["models"])


def _model_object(card: ModelCard) -> ModelObject:
    return ModelObject(
        id=card.id, created=card.created, owned_by=card.owned_by, root=card.root, max_model_len=card.max_model_len
    )


@router.get("/v1/models", response_model=ModelList, responses={401: ERRORS[401]})
async def list_models(request: Request) -> ModelList:
    """The served models (chat and embedding), with their context length."""
    cards = await app_state(request).ctx.connector.models()
    return ModelList(data=[_model_object(c) for c in cards])


# :path so ids with a slash ("org/name") work, as they do on vLLM.
@router.get("/v1/models/{model_id:path}", response_model=ModelObject, responses={401: ERRORS[401], 404: ERRORS[404]})
async def retrieve_model(model_id: str, request: Request) -> ModelObject:
    """One served model."""
    for card in await app_state(request).ctx.connector.models():
        if card.id == model_id:
            return _model_object(card)
    raise ModelNotFound(model_id)
