"""The per-app handlers, kept on ``app.state.servelm`` (never in module globals)."""

from __future__ import annotations

from dataclasses import dataclass

from servelm.api.serving_base import ServingContext
from servelm.api.serving_chat import ServingChat
from servelm.api.serving_completion import ServingCompletion
from servelm.api.serving_embedding import ServingEmbedding
from servelm.api.serving_tokenize import ServingTokenize


@dataclass
class AppState:
    """Everything the routers reach through the request's app."""

    ctx: ServingContext
    chat: ServingChat
    completion: ServingCompletion
    embedding: ServingEmbedding
    tokenize: ServingTokenize

    @classmethod
    def build(cls, ctx: ServingContext) -> AppState:
        return cls(
            ctx=ctx,
            chat=ServingChat(ctx),
            completion=ServingCompletion(ctx),
            embedding=ServingEmbedding(ctx),
            tokenize=ServingTokenize(ctx),
        )
