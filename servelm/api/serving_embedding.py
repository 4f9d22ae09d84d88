"""POST /v1/embeddings."""

from __future__ import annotations

import base64
import struct
from typing import cast

from starlette.requests import Request
from starlette.responses import Response

from servelm.api.access_log import request_record
from servelm.api.errors import APIError, context_length_exceeded
from servelm.api.protocol import EmbeddingRequest
from servelm.api.ratelimit import rate_limit_ticket
from servelm.api.responses import EmbeddingData, EmbeddingResponse, EmbeddingUsage
from servelm.api.serving_base import OpenAIServing, cancel_on_disconnect, check_supported

# OpenAI's own limit on inputs per request.
MAX_INPUTS = 2048


def encode_base64(vector: list[float]) -> str:
    """Little-endian float32 bytes in base64, as OpenAI sends them."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


class ServingEmbedding(OpenAIServing):
    """Embeddings of strings or token id lists."""

    async def create(self, req: EmbeddingRequest, raw_request: Request) -> Response:
        """Handle one embeddings request."""
        check_supported(req)
        card = await self.model_card(req.model, "embed")
        inputs: list[str] | list[list[int]]
        if isinstance(req.input, str):
            inputs = [req.input]
        elif req.input and isinstance(req.input[0], int):
            inputs = [cast(list[int], list(req.input))]
        else:
            inputs = cast("list[str] | list[list[int]]", list(req.input))
        if not inputs:
            raise APIError("input must not be empty.", status=400, param="input")
        if len(inputs) > MAX_INPUTS:
            raise APIError(f"input may hold at most {MAX_INPUTS} items, got {len(inputs)}.", status=400, param="input")
        for i, item in enumerate(inputs):
            where = "input" if isinstance(req.input, str) else f"input[{i}]"
            if item == "":
                raise APIError("input must not be an empty string.", status=400, param=where)
            if isinstance(item, list):
                if not item:
                    raise APIError("Token id inputs must not be empty.", status=400, param=where)
                error = context_length_exceeded(card.max_model_len, len(item), 0, "input")
                if error is not None:
                    raise error

        # Text is tokenized by the engine, so only a lower bound is known up
        # front (a token per string); settle() charges the rest.
        ticket = rate_limit_ticket(raw_request)
        if ticket is not None:
            await ticket.reserve_tokens(sum(len(item) if isinstance(item, list) else 1 for item in inputs))
        try:
            outputs = await cancel_on_disconnect(raw_request, self.connector.embed(card.id, inputs))
        except BaseException:
            if ticket is not None:
                await ticket.settle(0)
            raise
        prompt_tokens = sum(o.num_tokens for o in outputs)
        if ticket is not None:
            await ticket.settle(prompt_tokens)
        record = request_record(raw_request)
        if record is not None:
            record.prompt_tokens = prompt_tokens
        if req.dimensions is not None:
            dim = len(outputs[0].embedding) if outputs else 0
            if req.dimensions != dim:
                raise APIError(
                    f"The model `{card.id}` only produces {dim}-dimensional embeddings; "
                    f"dimensions={req.dimensions} is not supported.",
                    status=400,
                    param="dimensions",
                )
        self.ctx.metrics.prompt_tokens.labels(card.id).inc(prompt_tokens)
        data = [
            EmbeddingData(
                index=i, embedding=encode_base64(o.embedding) if req.encoding_format == "base64" else o.embedding
            )
            for i, o in enumerate(outputs)
        ]
        response = EmbeddingResponse(
            data=data, model=card.id, usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
        )
        return Response(response.model_dump_json(), media_type="application/json")
