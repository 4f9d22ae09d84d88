"""A model family's tool-call format: how its calls read, parse and are forced by a grammar.

One description serves three jobs, so they cannot drift apart: the
incremental parser (:attr:`ToolCallFormat.syntax`), the text of calls in a
conversation's history for templates that know nothing of tools
(:meth:`ToolCallFormat.calls_text`), and the xgrammar structural tag that
forces a reply to be calls (:meth:`ToolCallFormat.structural_tag`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from servelm.engine.tool_parsers.parser import CallSyntax, ToolCallParser

# The longest run of whitespace forced arguments may hold: a small model
# sampling inside a grammar otherwise pads JSON with whitespace, token after
# token, until max_tokens cuts the call short. Enough for indented JSON.
MAX_WHITESPACE = 16


@dataclass(frozen=True)
class ToolCallFormat:
    """How one model family writes tool calls.

    A run of calls reads ``run_open``, then each call as ``call_open``
    ``{"name": NAME, "<arguments_key>": ARGUMENTS}`` ``call_close``,
    separated by ``separator``, then ``run_close``. ``keep_special_tokens``
    says the markers are special tokens of the family's tokenizers, which
    the detokenizer must keep in the text for the parser to see them.
    ``call_id_length``: the family's templates accept only tool-call ids of
    exactly this many letters and digits (Mistral's: 9).
    """

    name: str
    syntax: CallSyntax
    arguments_key: str = "arguments"
    run_open: str = ""
    run_close: str = ""
    call_open: str = ""
    call_close: str = ""
    separator: str = ""
    keep_special_tokens: bool = False
    call_id_length: int | None = None

    def parser(self) -> ToolCallParser:
        """A fresh parser for one choice's text."""
        return ToolCallParser(self.syntax)

    def call_begin(self, name: str) -> str:
        """A call's text up to its arguments."""
        return f'{self.call_open}{{"name": {json.dumps(name)}, "{self.arguments_key}": '

    @property
    def call_end(self) -> str:
        """A call's text after its arguments."""
        return "}" + self.call_close

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        """``(name, arguments JSON)`` calls as the model writes them."""
        body = self.separator.join(self.call_begin(name) + arguments + self.call_end for name, arguments in calls)
        return self.run_open + body + self.run_close

    def structural_tag(self, functions: list[tuple[str, dict[str, Any]]], one_call: bool) -> dict[str, Any]:
        """xgrammar's structural tag for a reply that is only calls of ``functions`` (name, parameters schema).

        At least one call; exactly one with ``one_call``. Each call's
        arguments validate against its function's parameters.
        """
        tags = [
            {
                "type": "tag",
                "begin": self.call_begin(name),
                "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE},
                "end": self.call_end,
            }
            for name, schema in functions
        ]
        calls: dict[str, Any] = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": self.separator,
            "at_least_one": True,
            "stop_after_first": one_call,
        }
        elements = [{"type": "const_string", "value": s} for s in (self.run_open,) if s]
        elements.append(calls)
        elements += [{"type": "const_string", "value": s} for s in (self.run_close,) if s]
        return {
            "type": "structural_tag",
            "format": calls if len(elements) == 1 else {"type": "sequence", "elements": elements},
        }
