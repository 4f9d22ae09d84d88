"""Tool calling at the API edge: what a chat request's tools mean, and its calls in OpenAI's shapes.

:func:`plan_tools` checks ``tools``, ``tool_choice`` and
``parallel_tool_calls`` (a 400 naming the field for anything OpenAI would
refuse) and decides how the request runs: the definitions go to the chat
template; ``"auto"`` parses replies in the model's tool-call format;
``"required"`` and a named function also force the reply to be calls
through a grammar (an xgrammar structural tag), so even a small model
cannot answer in prose; ``"none"`` renders the tools (as vLLM does) but
never parses. :class:`ToolCallReplies` gives the calls ids and OpenAI's
reply, stream and ``finish_reason`` shapes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jsonschema import SchemaError
from jsonschema.validators import validator_for

from servelm.api.errors import APIError
from servelm.api.protocol import ChatCompletionRequest
from servelm.api.structured import StructuredRequest
from servelm.api.tool_protocol import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    ToolDefinition,
)
from servelm.connectors.base import ModelCard
from servelm.engine.outputs import ToolCallDelta
from servelm.engine.sampling_params import SamplingParams
from servelm.engine.structured_outputs import StructuredOutputsError, StructuredOutputsParams, unenforced_keyword
from servelm.engine.tool_parsers import AUTO, detect_format, get_format

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's tools shape its generation and its reply.

    ``tools``: the definitions for the chat template (None: none).
    ``parser``: the tool-call format replies are parsed in (None: never).
    ``structural_tag``: the grammar forcing the reply to be calls (None: free).
    ``named``: tool_choice named a function (OpenAI then ends with
    ``finish_reason`` ``stop``, not ``tool_calls``). ``one_call``: at most
    one call per choice (``parallel_tool_calls: false`` or a named function).
    """

    tools: list[dict[str, Any]] | None = None
    parser: str | None = None
    structural_tag: dict[str, Any] | None = None
    named: bool = False
    one_call: bool = False


def tool_format(setting: str, chat_template_override: str | None, card: ModelCard) -> str:
    """The tool-call format of a model: ``--tool-call-parser`` unless ``auto``, else its chat template's."""
    if setting != AUTO:
        return setting
    if chat_template_override is not None:
        return detect_format(chat_template_override)
    return card.tool_call_parser or detect_format(None)


def tool_definitions(tools: list[ToolDefinition] | None) -> list[dict[str, Any]] | None:
    """The definitions as the chat template gets them (None for none); a 400 naming the first bad field."""
    _functions(tools)
    return _definitions(tools)


def _definitions(tools: list[ToolDefinition] | None) -> list[dict[str, Any]] | None:
    return [t.model_dump(exclude_none=True, exclude={"custom"}) for t in tools] if tools else None


def plan_tools(req: ChatCompletionRequest, fmt: str) -> ToolPlan:
    """Check the request's tool fields and decide how its tools run (``fmt``: the model's format)."""
    tools = req.tools or []
    functions = _functions(tools)
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice != "none":
            raise APIError("tool_choice is only allowed when tools are given.", status=400, param="tool_choice")
        return ToolPlan()
    definitions = _definitions(tools)
    if choice == "none":
        return ToolPlan(tools=definitions)
    one_call = req.parallel_tool_calls is False
    if choice == "auto":
        return ToolPlan(tools=definitions, parser=fmt, one_call=one_call)
    if isinstance(choice, NamedToolChoice):
        wanted = choice.function.name
        if wanted not in functions:
            raise APIError(
                f"tool_choice names the function '{wanted}', which is not among the tools.",
                status=400,
                param="tool_choice",
            )
        forced, one_call, named = [(wanted, functions[wanted])], True, True
    else:  # "required"
        forced, named = list(functions.items()), False
    names = list(functions)
    for name, schema in forced:
        problem = unenforced_keyword(schema)
        if problem is not None:
            where = f"tools[{names.index(name)}].function.parameters"
            raise APIError(
                f"'{where}' {problem} in a forced call.", status=400, param=where, code=StructuredOutputsError.code
            )
    tag = get_format(fmt).structural_tag(forced, one_call=one_call)
    return ToolPlan(tools=definitions, parser=fmt, structural_tag=tag, named=named, one_call=one_call)


def _functions(tools: list[ToolDefinition] | None) -> dict[str, dict[str, Any]]:
    """Each tool's function name and parameters schema; a 400 naming the first bad field."""
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if tool.type != "function" or tool.custom is not None:
            raise APIError(
                f"Only tools of type 'function' are supported, not '{tool.type}'.", status=400, param=f"{where}.type"
            )
        if tool.function is None:
            raise APIError(f"Missing required parameter: '{where}.function'.", status=400, param=f"{where}.function")
        name = tool.function.name
        if not _NAME.fullmatch(name):
            raise APIError(
                f"Invalid function name '{name}': use letters, digits, '_' and '-', at most 64 characters.",
                status=400,
                param=f"{where}.function.name",
            )
        if name in functions:
            raise APIError(f"Two tools are named '{name}'.", status=400, param=f"{where}.function.name")
        functions[name] = _parameters(tool.function.parameters, f"{where}.function.parameters")
    return functions


def _parameters(schema: dict[str, Any] | None, where: str) -> dict[str, Any]:
    if schema is None or schema == {}:
        return _NO_PARAMETERS
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.path)
        raise APIError(f"Invalid JSON Schema in '{where}{path}': {exc.message}.", status=400, param=where) from None
    except RecursionError:
        raise APIError(f"The JSON Schema in '{where}' is nested too deeply.", status=400, param=where) from None
    if schema.get("type", "object") != "object":
        raise APIError(
            f'\'{where}\' must describe an object ("type": "object"), not {schema["type"]!r}.',
            status=400,
            param=where,
        )
    return schema


def forced_calls(plan: ToolPlan, structured: StructuredRequest) -> StructuredRequest:
    """The request's structured output once tools are planned: the plan's grammar when it forces calls.

    Errors the engine raises compiling it name ``tools``. A forced reply is
    calls only, so it cannot also follow a structured output the client asked for.
    """
    if plan.structural_tag is None:
        return structured
    if structured.params is not None:
        raise APIError(
            "tool_choice forces the reply to be tool calls; it cannot also follow "
            f"{next(iter(structured.param_names.values()))}.",
            status=400,
            param="tool_choice",
        )
    params = StructuredOutputsParams(structural_tag=json.dumps(plan.structural_tag))
    return StructuredRequest(params, {"structured_outputs": "tools", "structured_outputs.structural_tag": "tools"})


def apply_plan(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """``params`` as the plan runs them: replies parsed in its format."""
    if plan.parser is None:
        return params
    return params.parsing_tool_calls(plan.parser)


@dataclass
class ToolCallReplies:
    """One request's tool calls in OpenAI's shapes: ids, stream pieces, messages and finish_reason."""

    plan: ToolPlan
    new_id: Callable[[], str]
    _ids: dict[tuple[int, int], str] = field(default_factory=dict)  # (choice, call index) -> id

    def _kept(self, calls: list[ToolCallDelta]) -> list[ToolCallDelta]:
        # parallel_tool_calls false without a grammar to enforce it: the first call only, as vLLM.
        return [c for c in calls if c.index == 0] if self.plan.one_call else calls

    def _id(self, choice: int, index: int) -> str:
        key = (choice, index)
        if key not in self._ids:
            self._ids[key] = f"call_{self.new_id()[:24]}"
        return self._ids[key]

    def stream_pieces(self, choice: int, pieces: list[ToolCallDelta]) -> list[DeltaToolCall]:
        """Stream deltas: a call's first names it (with its id and empty arguments), then arguments."""
        out = []
        for piece in self._kept(pieces):
            if piece.name is not None:
                out.append(
                    DeltaToolCall(
                        index=piece.index,
                        id=self._id(choice, piece.index),
                        type="function",
                        function=DeltaFunctionCall(name=piece.name, arguments=""),
                    )
                )
            if piece.arguments:
                out.append(DeltaToolCall(index=piece.index, function=DeltaFunctionCall(arguments=piece.arguments)))
        return out

    def message_calls(self, choice: int, calls: list[ToolCallDelta]) -> list[ToolCall] | None:
        """A reply message's ``tool_calls`` (None when the choice made none)."""
        kept = [c for c in self._kept(calls) if c.name is not None]
        if not kept:
            return None
        return [
            ToolCall(id=self._id(choice, c.index), function=FunctionCall(name=c.name or "", arguments=c.arguments))
            for c in kept
        ]

    def finish_reason(self, choice: int, reason: str | None) -> str | None:
        """``tool_calls`` for a choice that called (and stopped by itself), unless the function was named."""
        called = any(key[0] == choice for key in self._ids)
        if called and reason == "stop" and not self.plan.named:
            return "tool_calls"
        return reason
