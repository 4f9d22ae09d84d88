"""The incremental tool-call parser: text deltas in, content deltas and tool-call deltas out.

One parser reads one choice's text as the detokenizer releases it. Tool
calls are JSON objects in runs that a model family marks its own way (see
:class:`CallSyntax`); everything else is content. Text that might still be
the start of a call (a partial marker, or whitespace that would be dropped
before a call) is held back until it is clear either way, as the
detokenizer holds back a possible stop string; :meth:`ToolCallParser.finish`
releases it. A run that turns out not to be a call (bad JSON, a key a call
does not have) goes out as content, so a reply in prose or plain JSON loses
nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from servelm.engine.outputs import ToolCallDelta
from servelm.engine.tool_parsers.json_call import CallObjectScanner, NotACall

_WHITESPACE = frozenset(" \t\n\r")

_CONTENT = "content"
_LITERAL = "literal"  # matching syntax.opening after a marker
_OBJECT_START = "object start"  # expecting the "{" of a call
_OBJECT = "object"
_AFTER_OBJECT = "after object"  # a separator, the closing, or the end of the run


@dataclass(frozen=True)
class CallSyntax:
    """Where a model family's tool calls sit in its text.

    A run of calls opens with one of ``markers`` (anywhere in the text), or,
    with ``bare_start``, with a call object as the first thing in the text;
    ``opening`` follows the marker, call objects are separated by
    ``separator`` and the run ends with ``closing`` (or, without one, at the
    first text that is not a separator). Whitespace may come between any
    two of these.
    """

    markers: tuple[str, ...]
    opening: str = ""
    separator: str | None = None
    closing: str | None = None
    bare_start: bool = False


@dataclass
class ParsedText:
    """What one piece of text added: content, and pieces of tool calls in order."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallParser:
    """Splits one choice's text into content and tool calls, a piece at a time.

    Whitespace right before and right after a run of calls is dropped, so a
    reply that is only calls has empty content. The first piece of each call
    carries its name and empty arguments; the arguments follow as they are
    written when they are a JSON object (a string is decoded and sent whole
    at the end of the call; no arguments at all read as ``{}``).
    """

    def __init__(self, syntax: CallSyntax):
        self.syntax = syntax
        self._state = _CONTENT
        self._held = ""  # content held back: trailing whitespace and a possible marker's start
        self._at_start = True  # nothing but whitespace read yet
        self._after_run = False  # a run just ended: drop the whitespace that follows it
        self._unclaimed = ""  # text of the current run that no call has claimed yet
        self._run_calls = 0  # calls completed in the current run
        self._literal = ""  # what of syntax.opening / separator / closing has been matched
        self._scanner: CallObjectScanner | None = None
        self._header_sent = False
        self._arguments_sent = 0
        self._num_calls = 0
        self._out = ParsedText()

    def feed(self, text: str) -> ParsedText:
        """Read the next piece of the choice's text."""
        for ch in text:
            self._read(ch)
        return self._take()

    def finish(self) -> ParsedText:
        """The text is over: release what was held back (a call cut short keeps what it has)."""
        if self._state == _CONTENT:
            self._emit_content(self._held)
            self._held = ""
        else:
            self._abandon_run()
        return self._take()

    # -- content -------------------------------------------------------

    def _read(self, ch: str) -> None:
        if self._state == _CONTENT:
            self._read_content(ch)
            return
        try:
            self._read_run(ch)
        except NotACall:
            self._abandon_run()
            self._read_content(ch)

    def _abandon_run(self) -> None:
        # What the run read since its last call is not a call: it goes out as
        # content when the run has no call, else it is dropped; a call whose
        # name was sent stays, cut where it broke.
        if self._state == _OBJECT and self._header_sent:
            self._num_calls += 1
            self._run_calls += 1
        if self._run_calls == 0:
            self._emit_content(self._unclaimed)
        self._unclaimed = self._literal = ""
        self._state = _CONTENT
        self._after_run = self._run_calls > 0

    def _read_content(self, ch: str) -> None:
        if self._at_start and ch not in _WHITESPACE:
            self._at_start = False
            if self.syntax.bare_start and ch == "{":
                self._start_run(self._held)
                self._start_object(ch)
                return
        # Held back: trailing whitespace (dropped if a run follows) and what may start a marker.
        held = self._held + ch
        if any(held.endswith(marker) for marker in self.syntax.markers):
            self._start_run(held)
            self._state = _LITERAL if self.syntax.opening else _OBJECT_START
            return
        partial = _marker_prefix_length(held, self.syntax.markers)
        text = held[: len(held) - partial].rstrip()
        self._emit_content(text)
        self._held = held[len(text) :]

    def _emit_content(self, text: str) -> None:
        if self._after_run:
            text = text.lstrip()
            if not text:
                return
            self._after_run = False
        self._out.content += text

    # -- runs of calls ---------------------------------------------------

    def _start_run(self, text: str) -> None:
        self._held = ""
        self._unclaimed = text
        self._run_calls = 0
        self._literal = ""

    def _read_run(self, ch: str) -> None:
        if self._state == _OBJECT:
            self._read_object(ch)
            return
        if ch in _WHITESPACE and not self._literal:
            self._unclaimed += ch
            return
        if self._state == _OBJECT_START:
            if ch != "{":
                raise NotACall("a call is a JSON object")
            self._start_object(ch)
            return
        if self._state == _LITERAL:
            if not self.syntax.opening.startswith(self._literal + ch):
                raise NotACall("not the run's opening")
            self._unclaimed += ch
            self._literal += ch
            if self._literal == self.syntax.opening:
                self._literal = ""
                self._state = _OBJECT_START
        else:
            self._unclaimed += ch
            self._read_after_object(ch)

    def _read_after_object(self, ch: str) -> None:
        self._literal += ch
        separator, closing = self.syntax.separator, self.syntax.closing
        if self._literal == separator:
            self._literal = ""
            self._state = _OBJECT_START
        elif self._literal == closing:
            self._end_run()
        elif not (separator or "").startswith(self._literal) and not (closing or "").startswith(self._literal):
            # Neither: the run is over (a missing closing is forgiven).
            partial = self._literal[:-1]
            self._end_run()
            self._emit_content(partial)
            self._read_content(ch)

    def _end_run(self) -> None:
        self._state = _CONTENT
        self._unclaimed = self._literal = ""
        self._after_run = True

    def _start_object(self, ch: str) -> None:
        self._state = _OBJECT
        self._scanner = CallObjectScanner()
        self._header_sent = False
        self._arguments_sent = 0
        self._read_object(ch)

    def _read_object(self, ch: str) -> None:
        scanner = self._scanner
        assert scanner is not None
        scanner.feed(ch)
        if scanner.done and scanner.name is None:
            raise NotACall("a call needs a name")  # before ``ch`` is claimed: it is read again as content
        first = scanner.text[scanner.arguments_start] if scanner.arguments_start is not None else None
        if not self._header_sent:
            self._unclaimed += ch
            if scanner.name is not None and (first == "{" or scanner.done):
                self._send_header(scanner.name)
        if self._header_sent and first == "{":
            self._send_arguments(scanner.arguments[self._arguments_sent :])
        if not scanner.done:
            return
        if first is None:
            self._send_arguments("{}")
        elif first == '"':
            self._send_arguments(json.loads(scanner.arguments))
        elif first != "{":
            self._send_arguments(scanner.arguments)
        self._num_calls += 1
        self._run_calls += 1
        self._state = _AFTER_OBJECT
        self._literal = ""

    def _send_header(self, name: str) -> None:
        assert self._scanner is not None
        self._header_sent = True
        self._scanner.strict_keys = False  # a call now: other keys are the model's business
        self._unclaimed = ""
        self._out.tool_calls.append(ToolCallDelta(self._num_calls, name, ""))

    def _send_arguments(self, text: str) -> None:
        if not text:
            return
        self._arguments_sent += len(text)
        calls = self._out.tool_calls
        if calls and calls[-1].index == self._num_calls and calls[-1].name is None:
            calls[-1].arguments += text
        else:
            calls.append(ToolCallDelta(self._num_calls, None, text))

    def _take(self) -> ParsedText:
        out, self._out = self._out, ParsedText()
        return out


def _marker_prefix_length(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    longest = max((len(m) for m in markers), default=0)
    for length in range(min(len(text), longest - 1), 0, -1):
        suffix = text[-length:]
        if any(m.startswith(suffix) for m in markers):
            return length
    return 0
