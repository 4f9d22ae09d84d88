"""Mistral tool calls: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

``[TOOL_CALLS]`` is a special token of Mistral's tokenizers (v3 and later),
so the detokenizer keeps special tokens. This is the JSON-array form of
Mistral 7B v0.3, Mixtral 8x22B and Mistral Nemo; the later
``[TOOL_CALLS]name[ARGS]{...}`` form is not read.
"""

from __future__ import annotations

from servelm.engine.tool_parsers.format import ToolCallFormat
from servelm.engine.tool_parsers.parser import CallSyntax

MISTRAL = ToolCallFormat(
    name="mistral",
    syntax=CallSyntax(markers=("[TOOL_CALLS]",), opening="[", separator=",", closing="]"),
    run_open="[TOOL_CALLS][",
    run_close="]",
    separator=", ",
    keep_special_tokens=True,
    call_id_length=9,
)
