"""Reading one tool-call JSON object (``{"name": ..., "arguments": {...}}``) a character at a time.

Tool calls stream: a client wants the function's name as soon as it is
known and then the arguments as the model writes them. ``json.loads`` needs
the whole object, so :class:`CallObjectScanner` checks JSON syntax
character by character (a pushdown automaton) and tracks, at the object's
top level, the ``name`` string and the raw text of the ``arguments`` (or
Llama's ``parameters``) value. Every character it accepted is valid JSON so
far, so arguments text handed out before the object closes is a prefix of
valid JSON, never text that turns out not to be a call.
"""

from __future__ import annotations

import json
import re

# Top-level keys a call object may have. Any other key before the call is
# recognised means the JSON is something else (an answer that happens to be
# JSON), not a call.
ARGUMENT_KEYS = ("arguments", "parameters")
CALL_KEYS = frozenset({"name", "id", "type", *ARGUMENT_KEYS})

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_WHITESPACE = frozenset(" \t\n\r")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_HEX = frozenset("0123456789abcdefABCDEF")

# What the automaton expects next.
_VALUE = "value"
_FIRST_KEY = "first key"  # just after "{": a key or "}"
_KEY = "key"  # after ",": a key
_COLON = "colon"
_FIRST_ITEM = "first item"  # just after "[": a value or "]"
_AFTER = "after value"  # "," or the container's closing bracket
_STRING = "string"
_ESCAPE = "escape"
_UNICODE = "unicode"
_NUMBER_STATE = "number"
_LITERAL = "literal"


class NotACall(ValueError):
    """The text is not a tool-call object: bad JSON, or a key a call does not have."""


class CallObjectScanner:
    """Checks one JSON object, fed character by character, and reads a tool call out of it.

    ``name`` is the call's function name once its string has closed;
    ``arguments_start`` is the offset in ``text`` where the arguments value
    begins (None until then) and ``arguments_end`` where it ends; ``done``
    turns true when the object's closing brace is read. :meth:`feed` raises
    :class:`NotACall` on a syntax error or, while ``strict_keys``, on a
    top-level key a call object does not have.
    """

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None
        self.arguments_start: int | None = None
        self.arguments_end: int | None = None
        self.done = False
        self.strict_keys = True
        self._stack: list[str] = []  # "{" or "[" per open container
        self._state = _VALUE
        self._string_start = 0
        self._string_is_key = False
        self._unicode_left = 0
        self._number_start = 0
        self._literal_left = ""
        self._key: str | None = None  # the top-level key whose value is being read
        self._top_value_start = 0  # where that value began

    @property
    def arguments(self) -> str:
        """The arguments value's raw text read so far ("" before it starts)."""
        if self.arguments_start is None:
            return ""
        return self.text[self.arguments_start : self.arguments_end]

    def feed(self, ch: str) -> None:
        """Read one more character of the object."""
        if self.done:
            raise NotACall("text after the end of the call object")
        self.text += ch
        self._read(ch)

    def _read(self, ch: str) -> None:
        state = self._state
        if state == _STRING:
            if ch == '"':
                self._end_string()
            elif ch == "\\":
                self._state = _ESCAPE
            elif ch < " ":
                raise NotACall("control character in a string")
        elif state == _ESCAPE:
            if ch == "u":
                self._state, self._unicode_left = _UNICODE, 4
            elif ch in '"\\/bfnrt':
                self._state = _STRING
            else:
                raise NotACall(f"bad escape \\{ch}")
        elif state == _UNICODE:
            if ch not in _HEX:
                raise NotACall("bad \\u escape")
            self._unicode_left -= 1
            if self._unicode_left == 0:
                self._state = _STRING
        elif state == _NUMBER_STATE:
            if ch in _NUMBER_CHARS:
                return
            self._end_number(len(self.text) - 1)
            self._read(ch)
        elif state == _LITERAL:
            if ch != self._literal_left[0]:
                raise NotACall("bad literal")
            self._literal_left = self._literal_left[1:]
            if not self._literal_left:
                self._end_value(len(self.text))
        elif ch in _WHITESPACE:
            return
        elif state in (_VALUE, _FIRST_ITEM):
            if state == _FIRST_ITEM and ch == "]":
                self._close("[")
            else:
                self._start_value(ch)
        elif state in (_FIRST_KEY, _KEY):
            if ch == '"':
                self._state, self._string_start, self._string_is_key = _STRING, len(self.text) - 1, True
            elif ch == "}" and state == _FIRST_KEY:
                self._close("{")
            else:
                raise NotACall("expected a key")
        elif state == _COLON:
            if ch != ":":
                raise NotACall("expected ':'")
            self._state = _VALUE
        elif state == _AFTER:
            top = self._stack[-1]
            if ch == ",":
                self._state = _KEY if top == "{" else _VALUE
            elif (ch == "}" and top == "{") or (ch == "]" and top == "["):
                self._close(top)
            else:
                raise NotACall(f"unexpected {ch!r}")

    def _start_value(self, ch: str) -> None:
        if not self._stack and ch != "{":
            raise NotACall("a call is a JSON object")
        start = len(self.text) - 1
        if len(self._stack) == 1:
            self._top_value_start = start
            if self._key in ARGUMENT_KEYS and self.arguments_start is None:
                self.arguments_start = start
        if ch in "{[":
            self._stack.append(ch)
            self._state = _FIRST_KEY if ch == "{" else _FIRST_ITEM
        elif ch == '"':
            self._state, self._string_start, self._string_is_key = _STRING, start, False
        elif ch == "-" or ch in "0123456789":
            self._state, self._number_start = _NUMBER_STATE, start
        elif ch in _LITERALS:
            self._state, self._literal_left = _LITERAL, _LITERALS[ch][1:]
        else:
            raise NotACall(f"unexpected {ch!r}")

    def _end_string(self) -> None:
        end = len(self.text)
        if self._string_is_key:
            self._state = _COLON
            if len(self._stack) == 1:
                self._key = json.loads(self.text[self._string_start : end])
                if self.strict_keys and self._key not in CALL_KEYS:
                    raise NotACall(f"a call has no key {self._key!r}")
            return
        if len(self._stack) == 1 and self._key == "name" and self.name is None:
            self.name = json.loads(self.text[self._string_start : end])
        self._end_value(end)

    def _end_number(self, end: int) -> None:
        if not _NUMBER.fullmatch(self.text[self._number_start : end]):
            raise NotACall("bad number")
        self._end_value(end)

    def _close(self, bracket: str) -> None:
        self._stack.pop()
        if not self._stack:
            self.done = True
            return
        self._end_value(len(self.text))

    def _end_value(self, end: int) -> None:
        # A value just ended at ``end``; at the top level, it is the current key's.
        self._state = _AFTER
        if len(self._stack) == 1:
            if self._key == "name" and self.name is None:
                raise NotACall("a call's name is a string")
            if self.arguments_start == self._top_value_start and self.arguments_end is None:
                self.arguments_end = end
            self._key = None
