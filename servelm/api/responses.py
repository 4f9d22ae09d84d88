"""OpenAI-compatible response schemas (pydantic v2): what the server sends back, in OpenAI's shapes.

The requests they answer are in :mod:`servelm.api.protocol`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_serializer

from servelm.api.tool_protocol import DeltaToolCall, ToolCall


class ChatLogprobTop(BaseModel):
    """One alternative token at a position (chat logprobs format)."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprobEntry(ChatLogprobTop):
    """The chosen token at a position, with its top alternatives."""

    top_logprobs: list[ChatLogprobTop]


class ChatLogprobs(BaseModel):
    """A chat choice's logprobs: one entry per generated token."""

    content: list[ChatLogprobEntry] | None
    refusal: list[ChatLogprobEntry] | None = None


class ChatResponseMessage(BaseModel):
    """The assistant message of a chat choice."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    annotations: list[Any] = Field(default_factory=list)  # OpenAI's web-search citations: never any here
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=lambda v: v is None)


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class PromptTokensDetails(BaseModel):
    """Prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    """OpenAI's breakdown of completion tokens: servelm has no reasoning, audio or predicted outputs."""

    reasoning_tokens: int = 0
    audio_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    """Token usage of a request."""

    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class ChatCompletionResponse(BaseModel):
    """A (non-streamed) chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """What a stream chunk adds to a chat choice."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    """One choice's delta in a stream chunk."""

    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None

    @field_serializer("delta")
    def _compact_delta(self, delta: ChatDelta) -> dict[str, Any]:
        # OpenAI omits absent delta keys: the last chunk's delta is {}.
        return delta.model_dump(exclude_none=True)


class ChatCompletionChunk(BaseModel):
    """One streamed chat event (``chat.completion.chunk``)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice of a text completion (or its piece, when streamed)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    """A text completion, or one streamed event of one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class EmbeddingData(BaseModel):
    """One input's embedding: floats, or base64 little-endian float32."""

    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class EmbeddingUsage(BaseModel):
    """Token usage of an embeddings request."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    """The embeddings of a request's inputs."""

    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ModelObject(BaseModel):
    """A served model, with its context length (``max_model_len``, as vLLM)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    """The served models."""

    object: Literal["list"] = "list"
    data: list[ModelObject]


class TokenizeResponse(BaseModel):
    """Token ids, their count and the model's context length."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    """The text of the token ids."""

    prompt: str


class ErrorDetail(BaseModel):
    """The fields of an error."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope."""

    error: ErrorDetail
