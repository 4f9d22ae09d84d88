"""Llama 3.x JSON tool calls: ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``.

A reply that starts with a call object is calls (several separated by
``;``); ``<|python_tag|>`` (a special token, so the detokenizer keeps special
tokens) opens calls anywhere. Forced replies are bare objects.
"""

from __future__ import annotations

from servelm.engine.tool_parsers.format import ToolCallFormat
from servelm.engine.tool_parsers.parser import CallSyntax

LLAMA3_JSON = ToolCallFormat(
    name="llama3_json",
    syntax=CallSyntax(markers=("<|python_tag|>",), separator=";", bare_start=True),
    arguments_key="parameters",
    separator="; ",
    keep_special_tokens=True,
)
