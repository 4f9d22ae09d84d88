"""OpenAI's tool-calling schemas (pydantic): tool definitions, tool_choice and tool calls.

Requests' tool fields and the tool calls of replies and stream deltas, in
OpenAI's shapes. What the fields mean for a request is decided in
:mod:`servelm.api.tools`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from servelm.api.request_model import RequestModel


class FunctionDefinition(RequestModel):
    """A function the model may call."""

    SCAN_TEXT: ClassVar[bool] = False  # always inside a request body, which scans it

    name: str = Field(description="Letters, digits, '_' and '-', at most 64 characters.")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="A JSON Schema of the arguments (an object); none means no arguments."
    )
    strict: bool | None = Field(None, description="Accepted; forced calls always follow the schema.")


class ToolDefinition(RequestModel):
    """One entry of ``tools``: only ``{"type": "function", "function": {...}}``."""

    SCAN_TEXT: ClassVar[bool] = False

    type: str
    function: FunctionDefinition | None = None
    custom: dict[str, Any] | None = Field(None, description="Custom tools are not supported; rejected.")


class FunctionName(RequestModel):
    """The function a named ``tool_choice`` calls."""

    SCAN_TEXT: ClassVar[bool] = False

    name: str


class NamedToolChoice(RequestModel):
    """``tool_choice`` naming the one function to call."""

    SCAN_TEXT: ClassVar[bool] = False

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallParam(RequestModel):
    """The function an assistant message called: its name and JSON arguments."""

    SCAN_TEXT: ClassVar[bool] = False

    name: str
    arguments: str


class ToolCallParam(RequestModel):
    """A tool call in an assistant message of the conversation."""

    SCAN_TEXT: ClassVar[bool] = False

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


# --- replies ------------------------------------------------------------------


class FunctionCall(BaseModel):
    """The function a reply calls; ``arguments`` is a JSON object as text."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """A tool call of a reply's message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    """A piece of a streamed call: the name in its first piece, then pieces of the arguments."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call; ``index`` says which call of the choice."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall
