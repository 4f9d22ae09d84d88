"""Tool calls in model text: one module per model family's format, a registry, and the
incremental parser they share (pure Python: the API imports it to build forcing grammars)."""

from servelm.engine.tool_parsers.format import ToolCallFormat
from servelm.engine.tool_parsers.parser import CallSyntax, ParsedText, ToolCallParser
from servelm.engine.tool_parsers.registry import AUTO, FORMATS, detect_format, get_format, resolve_format

__all__ = [
    "AUTO",
    "FORMATS",
    "CallSyntax",
    "ParsedText",
    "ToolCallFormat",
    "ToolCallParser",
    "detect_format",
    "get_format",
    "resolve_format",
]
