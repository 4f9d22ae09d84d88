"""POST /v1/completions (the legacy text completions API)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from servelm.api.access_log import response_id
from servelm.api.errors import APIError, context_length_exceeded, with_param_renamed
from servelm.api.generation_run import ChoiceDelta, ChoiceResult, GenerationRun
from servelm.api.logprobs import TextOffsets, legacy_logprobs
from servelm.api.protocol import CompletionRequest
from servelm.api.responses import CompletionChoice, CompletionLogprobs, CompletionResponse, Usage
from servelm.api.serving_base import check_supported, sampling_params
from servelm.api.serving_generation import GenerationServing
from servelm.api.structured import structured_request
from servelm.connectors.base import ConnectorError
from servelm.engine.outputs import PositionLogprobs


@dataclass
class CompletionFormatter:
    """``text_completion`` objects, streamed or not, with echo and legacy logprobs.

    With echo, a choice's first piece carries its prompt's text (and, with
    logprobs, the prompt tokens' logprobs, the first one null).
    """

    id: str
    created: int
    model: str
    fingerprint: str
    include_usage: bool
    logprobs: bool
    echo_texts: list[str] | None  # per prompt, when echo
    first_token_texts: list[str]  # per prompt: text of the first prompt token (echo + logprobs)
    _offsets: dict[int, TextOffsets] = field(default_factory=dict)  # streaming: the text offsets of each choice

    def _piece(
        self,
        run: GenerationRun,
        prompt_index: int,
        text: str,
        entries: list[PositionLogprobs] | None,
        first: bool,
        offsets: TextOffsets,
    ) -> tuple[str, CompletionLogprobs | None]:
        lp_entries: list[PositionLogprobs | None] = []
        if first and self.echo_texts is not None:
            text = self.echo_texts[prompt_index] + text
            if self.logprobs:
                lp_entries.extend(run.prompt_logprobs[prompt_index] or [])
        if not self.logprobs:
            return text, None
        lp_entries.extend(entries or [])
        first_text = self.first_token_texts[prompt_index] if self.first_token_texts else ""
        return text, legacy_logprobs(lp_entries, offsets, first_text)

    def _object(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            system_fingerprint=self.fingerprint,
            choices=choices,
            usage=usage,
        )

    def stream_prologue(self) -> list[BaseModel]:
        return []

    def stream_chunks(self, delta: ChoiceDelta, run: GenerationRun) -> list[BaseModel]:
        first = delta.index not in self._offsets
        offsets = self._offsets.setdefault(delta.index, TextOffsets())
        text, logprobs = self._piece(run, delta.prompt_index, delta.text, delta.logprobs, first, offsets)
        if not text and not (logprobs and logprobs.tokens) and delta.finish_reason is None:
            return []
        choice = CompletionChoice(index=delta.index, text=text, logprobs=logprobs, finish_reason=delta.finish_reason)
        return [self._object([choice])]

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._object([], usage)

    def response(self, choices: list[ChoiceResult], run: GenerationRun) -> BaseModel:
        out = []
        for c in choices:
            text, logprobs = self._piece(run, c.prompt_index, c.text, c.logprobs, True, TextOffsets())
            out.append(CompletionChoice(index=c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason))
        return self._object(out, run.usage())


class ServingCompletion(GenerationServing):
    """Text completions: each prompt × n choices, indexed as OpenAI does."""

    async def create(self, req: CompletionRequest, raw_request: Request) -> Response:
        """Handle one completion request, streamed or not."""
        check_supported(req)
        stream = bool(req.stream)
        if stream and req.best_of is not None and req.best_of != req.n:
            raise APIError("best_of must equal n (or be unset) when streaming.", status=400, param="best_of")
        structured = structured_request(req)
        card = await self.model_card(req.model, "generate")
        prompts = _prompt_list(req.prompt)
        with_prompt_logprobs = bool(req.echo) and req.logprobs is not None
        params = sampling_params(
            req,
            max_tokens=req.max_tokens,
            logprobs=req.logprobs,
            prompt_logprobs=req.logprobs if with_prompt_logprobs else None,
            best_of=req.best_of,
            structured_outputs=structured.params,
        )
        prompt_ids: list[list[int]] = []
        for i, p in enumerate(prompts):
            # Tokenized here rather than by the engine so the context check below
            # (and its error message) is the same for text and token prompts.
            ids = p if isinstance(p, list) else await self.connector.tokenize(card.id, p, add_special_tokens=True)
            if not ids:
                raise APIError(
                    "The prompt is empty.", status=400, param="prompt" if len(prompts) == 1 else f"prompt[{i}]"
                )
            error = context_length_exceeded(card.max_model_len, len(ids), req.max_tokens, "prompt")
            if error is not None:
                raise error
            prompt_ids.append(ids)

        echo_texts: list[str] | None = None
        first_token_texts: list[str] = []
        if req.echo:
            echo_texts = [
                p if isinstance(p, str) else await self._prompt_text(card.id, p, i, len(prompts))
                for i, p in enumerate(prompts)
            ]
            if with_prompt_logprobs:
                first_token_texts = [await self.connector.detokenize(card.id, ids[:1]) for ids in prompt_ids]

        request_id = f"cmpl-{response_id(raw_request, self.ctx.new_id)}"
        run = GenerationRun(
            self.connector,
            card.id,
            request_id,
            prompt_ids,
            params,
            self.ctx.metrics,
            max_model_len=card.max_model_len,
            param_names=structured.param_names,
        )
        formatter = CompletionFormatter(
            id=request_id,
            created=int(self.ctx.clock()),
            model=card.id,
            fingerprint=self.fingerprint(card),
            include_usage=bool(stream and req.stream_options and req.stream_options.include_usage),
            logprobs=req.logprobs is not None,
            echo_texts=echo_texts,
            first_token_texts=first_token_texts,
        )
        return await self.respond(raw_request, run, formatter, stream)

    async def _prompt_text(self, model: str, ids: list[int], index: int, count: int) -> str:
        """The text of a token id prompt, for echo; an id outside the vocabulary is the prompt's error."""
        try:
            return await self.connector.detokenize(model, ids)
        except ConnectorError as exc:
            raise with_param_renamed(exc, {"tokens": "prompt" if count == 1 else f"prompt[{index}]"}) from None


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompts as a list: one string, several strings, or token id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError("The prompt is empty.", status=400, param="prompt")
    if isinstance(prompt[0], int):
        return [cast(list[int], list(prompt))]
    return cast("list[str | list[int]]", list(prompt))
