"""Hermes / Qwen tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one per tag.

The format of Hermes 2 Pro, Qwen 2.5 / Qwen 3 and most ChatML models; the
default for templates that do not say otherwise (the bundled SmolLM2's).
"""

from __future__ import annotations

from servelm.engine.tool_parsers.format import ToolCallFormat
from servelm.engine.tool_parsers.parser import CallSyntax

HERMES = ToolCallFormat(
    name="hermes",
    syntax=CallSyntax(markers=("<tool_call>",), closing="</tool_call>"),
    call_open="<tool_call>\n",
    call_close="\n</tool_call>",
    # Calls follow each other directly: a small model forced into calls takes a
    # newline after </tool_call> as the start of another call (and repeats the
    # same call until max_tokens), while without one it ends its reply.
    separator="",
)
