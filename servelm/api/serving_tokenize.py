"""POST /tokenize and /detokenize (vLLM's shapes)."""

from __future__ import annotations

from servelm.api.errors import APIError
from servelm.api.protocol import DetokenizeRequest, TokenizeRequest
from servelm.api.responses import DetokenizeResponse, TokenizeResponse
from servelm.api.serving_base import OpenAIServing
from servelm.api.tools import tool_definitions, tool_format


class ServingTokenize(OpenAIServing):
    """Tokenize a prompt or chat messages (rendered exactly as chat completions renders them)."""

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """Token ids of ``prompt``, or of ``messages`` after the chat template."""
        if (req.prompt is None) == (req.messages is None):
            raise APIError("Send exactly one of 'prompt' and 'messages'.", status=400, param="prompt")
        if req.tools and req.messages is None:
            raise APIError("tools go with 'messages'.", status=400, param="tools")
        if req.messages is not None:
            card = await self.model_card(req.model, "generate")
            text = await self.render_chat(
                card.id,
                req.messages,
                req.add_generation_prompt,
                req.chat_template_kwargs,
                tool_definitions(req.tools),
                tool_format(self.ctx.tool_call_parser, self.ctx.chat_template, card),
            )
            add_special = bool(req.add_special_tokens)  # default False: the template has them
        else:
            card = await self.model_card(req.model, None if req.model else "generate")
            assert req.prompt is not None
            text = req.prompt
            add_special = req.add_special_tokens is not False
        tokens = await self.connector.tokenize(card.id, text, add_special_tokens=add_special)
        return TokenizeResponse(count=len(tokens), max_model_len=card.max_model_len, tokens=tokens)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """The text of ``tokens``."""
        card = await self.model_card(req.model, None if req.model else "generate")
        return DetokenizeResponse(prompt=await self.connector.detokenize(card.id, req.tokens))
