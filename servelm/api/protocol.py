"""OpenAI-compatible request schemas (pydantic v2); the responses are in :mod:`servelm.api.responses`.

Requests forbid unknown fields, so a typo or an unsupported parameter is a
400 naming it rather than something silently ignored. Documented OpenAI
fields servelm cannot honour are declared (so the OpenAPI schema shows
them) and listed in each request's ``UNSUPPORTED`` table: a value other than
the harmless one is rejected by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator

from servelm.api.request_model import RequestModel, TokenIds, check_token_id_lists
from servelm.api.structured import ResponseFormat, StructuredOutputsRequest
from servelm.api.tool_protocol import ToolCallParam, ToolChoice, ToolDefinition


def _absent(value: Any) -> bool:
    return value is None or value == [] or value == {}


class OpenAIRequest(RequestModel):
    """Base of every request body: unknown fields are errors (and see :class:`RequestModel`)."""

    # field name -> predicate that is true for the values servelm can honour
    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {}

    def unsupported_param(self) -> str | None:
        """The first field set to a value servelm cannot honour, or None."""
        for name, acceptable in self.UNSUPPORTED.items():
            value = getattr(self, name)
            if value is not None and not acceptable(value):
                return name
        return None


class StreamOptions(RequestModel):
    """``stream_options``: usage reporting on streams."""

    SCAN_TEXT: ClassVar[bool] = False  # always inside a request body, which scans it

    include_usage: bool | None = Field(False, description="Send a last chunk with usage and empty choices.")
    include_obfuscation: bool | None = Field(
        None, description="Accepted; servelm adds no obfuscation padding to stream events."
    )


class SamplingFields(OpenAIRequest):
    """Sampling fields shared by chat and text completions (OpenAI's and vLLM's)."""

    model: str = Field(description="Name of a served model (see GET /v1/models).")
    n: int = Field(1, ge=1, le=128, description="Choices to generate.")
    temperature: float | None = Field(None, description="0 is greedy; default 1.")
    top_p: float | None = None
    top_k: int | None = Field(None, description="vLLM extension; -1 or 0 disables.")
    min_p: float | None = Field(None, description="vLLM extension.")
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = Field(None, description="vLLM extension; 1 disables.")
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = Field(None, description="vLLM extension.")
    include_stop_str_in_output: bool = Field(False, description="vLLM extension.")
    min_tokens: int = Field(0, description="vLLM extension.")
    ignore_eos: bool = Field(False, description="vLLM extension.")
    skip_special_tokens: bool = Field(True, description="vLLM extension.")
    speculative_decoding: bool = Field(
        True, description="servelm extension: false turns speculative decoding off for this request."
    )
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) to a bias in [-100, 100].")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="Accepted and ignored (end-user id).")
    # structured outputs (servelm/api/structured.py): at most one kind per request
    structured_outputs: StructuredOutputsRequest | None = Field(
        None, description="vLLM extension: constrain the output (exactly one of its fields)."
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM extension (older): a JSON schema.")
    guided_regex: str | None = Field(None, description="vLLM extension (older): a regular expression.")
    guided_choice: list[str] | None = Field(None, description="vLLM extension (older): one of these strings.")
    guided_grammar: str | None = Field(None, description="vLLM extension (older): an EBNF grammar.")


# --- chat completions -------------------------------------------------------


class ContentPart(RequestModel):
    """One part of a message's content; only ``type: "text"`` is supported."""

    model_config = ConfigDict(extra="allow")
    SCAN_TEXT: ClassVar[bool] = False  # always inside a request body, which scans it

    type: str
    text: str | None = None


class ChatMessage(RequestModel):
    """A chat message in the request."""

    SCAN_TEXT: ClassVar[bool] = False  # always inside a request body, which scans it

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = Field(None, description="For role tool: the call this message answers.")
    tool_calls: list[ToolCallParam] | None = Field(None, description="For role assistant: the calls it made.")
    refusal: str | None = Field(None, description="For role assistant: rendered as the content when content is null.")
    annotations: list[Any] | None = Field(
        None, description="For role assistant: accepted and ignored (a reply's message sent back as it came)."
    )
    audio: dict[str, Any] | None = Field(None, description="Not supported; rejected.")
    function_call: dict[str, Any] | None = Field(None, description="Not supported (deprecated); rejected.")


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, description="Default: up to the model's context length.")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM extensions
    add_generation_prompt: bool = Field(True, description="vLLM extension.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM extension: extra template variables.")
    # accepted, harmless
    metadata: dict[str, str] | None = None
    store: bool | None = Field(None, description="Only false: servelm stores nothing.")
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = Field(None, description="Accepted; prefix caching is automatic.")
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # tool calling (servelm/api/tools.py)
    tools: list[ToolDefinition] | None = Field(None, description="Functions the model may call.")
    tool_choice: ToolChoice | None = Field(
        None, description='"none", "auto" (the default with tools), "required" or a named function.'
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call per choice.")
    # documented by OpenAI, not supported: see UNSUPPORTED
    functions: list[Any] | None = Field(None, description="Not supported; rejected unless empty.")
    function_call: Any | None = Field(None, description='Not supported; only "none" is accepted.')
    response_format: ResponseFormat | None = Field(
        None, description='{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}.'
    )
    audio: dict[str, Any] | None = Field(None, description="Not supported; rejected.")
    modalities: list[str] | None = Field(None, description='Only ["text"].')
    prediction: dict[str, Any] | None = Field(None, description="Not supported; rejected.")
    web_search_options: dict[str, Any] | None = Field(None, description="Not supported; rejected.")
    reasoning_effort: str | None = Field(None, description='Not supported; only "none" is accepted.')
    verbosity: str | None = Field(None, description="Not supported; rejected.")
    moderation: dict[str, Any] | None = Field(None, description="Not supported; rejected.")

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "functions": _absent,
        "function_call": lambda v: v == "none",
        "audio": lambda v: False,
        "modalities": lambda v: v == ["text"],
        "prediction": lambda v: False,
        "web_search_options": lambda v: False,
        "reasoning_effort": lambda v: v == "none",
        "verbosity": lambda v: False,
        "moderation": lambda v: False,
        "store": lambda v: v is False,
    }


# --- text completions -------------------------------------------------------


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="A string, a list of strings, a list of token ids, or a list of lists of token ids."
    )
    max_tokens: int | None = Field(16, description="null: up to the model's context length.")
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1, le=128, description="Not with stream unless equal to n.")
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = Field(None, description="Not supported; rejected unless empty.")

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {"suffix": lambda v: v == ""}

    _token_ids = field_validator("prompt", mode="before")(check_token_id_lists)


# --- embeddings -------------------------------------------------------------


class EmbeddingRequest(OpenAIRequest):
    """POST /v1/embeddings."""

    model: str
    input: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="A string, a list of strings, a list of token ids, or a list of lists of token ids."
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, description="Only the model's own dimension is accepted.")
    user: str | None = None

    _token_ids = field_validator("input", mode="before")(check_token_id_lists)


# --- tokenize / detokenize (vLLM) -------------------------------------------


class TokenizeRequest(OpenAIRequest):
    """POST /tokenize: a ``prompt`` or chat ``messages``, not both."""

    model: str | None = Field(None, description="Default: the first chat model.")
    prompt: str | None = None
    add_special_tokens: bool | None = Field(
        None, description="Default true for prompt, false for messages (the template has them)."
    )
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = Field(None, description="With messages: rendered as chat completions does.")
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIRequest):
    """POST /detokenize."""

    model: str | None = Field(None, description="Default: the first chat model.")
    tokens: TokenIds
