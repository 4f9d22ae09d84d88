"""POST /v1/chat/completions."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from servelm.api.access_log import response_id
from servelm.api.errors import APIError, context_length_exceeded
from servelm.api.generation_run import ChoiceDelta, ChoiceResult, GenerationRun
from servelm.api.logprobs import chat_logprobs
from servelm.api.protocol import ChatCompletionRequest
from servelm.api.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    Usage,
)
from servelm.api.serving_base import check_supported, sampling_params
from servelm.api.serving_generation import GenerationServing
from servelm.api.structured import structured_request
from servelm.api.tools import ToolCallReplies, apply_plan, forced_calls, plan_tools, tool_format


@dataclass
class ChatFormatter:
    """Chat completion JSON: ``chat.completion`` objects and ``chat.completion.chunk`` events."""

    id: str
    created: int
    model: str
    fingerprint: str
    n: int
    logprobs: bool
    include_usage: bool
    tools: ToolCallReplies | None = None  # set when replies are parsed for tool calls

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, system_fingerprint=self.fingerprint, choices=[choice]
        )

    def stream_prologue(self) -> list[BaseModel]:
        # OpenAI opens each choice with its role and empty content before any text
        # (no content when the reply can only be tool calls).
        content = None if self.tools is not None and self.tools.plan.structural_tag is not None else ""
        return [
            self._chunk(ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=content)))
            for i in range(self.n)
        ]

    def stream_chunks(self, delta: ChoiceDelta, run: GenerationRun) -> list[BaseModel]:
        chunks: list[BaseModel] = []
        logprobs = ChatLogprobs(content=chat_logprobs(delta.logprobs or [])) if self.logprobs else None
        if delta.text or (logprobs is not None and logprobs.content):
            chunks.append(
                self._chunk(ChatChunkChoice(index=delta.index, delta=ChatDelta(content=delta.text), logprobs=logprobs))
            )
        finish_reason = delta.finish_reason
        if self.tools is not None:
            for piece in self.tools.stream_pieces(delta.index, delta.tool_calls):
                chunks.append(self._chunk(ChatChunkChoice(index=delta.index, delta=ChatDelta(tool_calls=[piece]))))
            finish_reason = self.tools.finish_reason(delta.index, finish_reason)
        if finish_reason is not None:
            chunks.append(
                self._chunk(ChatChunkChoice(index=delta.index, delta=ChatDelta(), finish_reason=finish_reason))
            )
        return chunks

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            system_fingerprint=self.fingerprint,
            choices=[],
            usage=usage,
        )

    def response(self, choices: list[ChoiceResult], run: GenerationRun) -> BaseModel:
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            system_fingerprint=self.fingerprint,
            choices=[self._choice(c) for c in choices],
            usage=run.usage(),
        )

    def _choice(self, c: ChoiceResult) -> ChatChoice:
        calls, finish_reason = None, c.finish_reason
        if self.tools is not None:
            calls = self.tools.message_calls(c.index, c.tool_calls)
            finish_reason = self.tools.finish_reason(c.index, finish_reason)
        return ChatChoice(
            index=c.index,
            # OpenAI's content is null when a reply is only tool calls.
            message=ChatResponseMessage(content=c.text if c.text or not calls else None, tool_calls=calls),
            logprobs=ChatLogprobs(content=chat_logprobs(c.logprobs or [])) if self.logprobs else None,
            finish_reason=finish_reason,
        )


class ServingChat(GenerationServing):
    """Chat completions: render the messages with the chat template, then generate."""

    async def create(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        """Handle one chat completion request, streamed or not."""
        check_supported(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs requires logprobs to be true.", status=400, param="top_logprobs")
        structured = structured_request(req)
        card = await self.model_card(req.model, "generate")
        tool_fmt = tool_format(self.ctx.tool_call_parser, self.ctx.chat_template, card)
        plan = plan_tools(req, tool_fmt)
        structured = forced_calls(plan, structured)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling_params(
            req,
            max_tokens=max_tokens,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            rename={
                "max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
                "logprobs": "top_logprobs",
            },
            structured_outputs=structured.params,
        )
        params = apply_plan(params, plan)
        text = await self.render_chat(
            card.id, req.messages, req.add_generation_prompt, req.chat_template_kwargs, plan.tools, tool_fmt
        )
        # The rendered template already holds the model's special tokens.
        prompt_ids = await self.connector.tokenize(card.id, text, add_special_tokens=False)
        error = context_length_exceeded(card.max_model_len, len(prompt_ids), max_tokens, "messages")
        if error is not None:
            raise error

        request_id = f"chatcmpl-{response_id(raw_request, self.ctx.new_id)}"
        run = GenerationRun(
            self.connector,
            card.id,
            request_id,
            [prompt_ids],
            params,
            self.ctx.metrics,
            max_model_len=card.max_model_len,
            param_names=structured.param_names,
        )
        stream = bool(req.stream)
        formatter = ChatFormatter(
            id=request_id,
            created=int(self.ctx.clock()),
            model=card.id,
            fingerprint=self.fingerprint(card),
            n=req.n,
            logprobs=bool(req.logprobs),
            include_usage=bool(stream and req.stream_options and req.stream_options.include_usage),
            tools=ToolCallReplies(plan, self.ctx.new_id) if plan.parser is not None else None,
        )
        return await self.respond(raw_request, run, formatter, stream)
