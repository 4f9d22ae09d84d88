"""Logprobs in OpenAI's two formats: chat's per-token entries and the legacy completions lists.

A token's ``bytes`` are its own (part of a character, for a token that holds
only some of its bytes), and its text is those bytes as UTF-8 with the bytes
of an unfinished character written as ``\\xNN`` escapes, as OpenAI's API
shows them.
"""

from __future__ import annotations

import codecs
import math

from servelm.api.responses import ChatLogprobEntry, ChatLogprobTop, CompletionLogprobs
from servelm.engine.outputs import PositionLogprobs

# JSON has no -inf; OpenAI-compatible servers report impossible tokens like this.
_MIN_LOGPROB = -9999.0


def clamp_logprob(value: float) -> float:
    """A JSON-safe logprob (no -inf or NaN)."""
    if math.isnan(value) or value < _MIN_LOGPROB:
        return _MIN_LOGPROB
    return value


def chat_logprobs(entries: list[PositionLogprobs]) -> list[ChatLogprobEntry]:
    """Logprobs in the chat format: token, logprob, UTF-8 bytes and the top alternatives."""
    return [
        ChatLogprobEntry(
            token=e.chosen.text,
            logprob=clamp_logprob(e.chosen.logprob),
            bytes=list(e.chosen.token_bytes),
            top_logprobs=[
                ChatLogprobTop(token=t.text, logprob=clamp_logprob(t.logprob), bytes=list(t.token_bytes)) for t in e.top
            ],
        )
        for e in entries
    ]


class TextOffsets:
    """Where each token's text starts in a choice's text, in characters, token after token.

    A token holding the first bytes of a character starts where the
    character does; the one that completes it, too. Streaming keeps one per
    choice, so the offsets run on across chunks.
    """

    def __init__(self, start: int = 0):
        self.next = start
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, token_bytes: bytes) -> int:
        """The offset of a token with these bytes; moves past it."""
        start = self.next
        self.next += len(self._utf8.decode(token_bytes))
        return start


def legacy_logprobs(
    entries: list[PositionLogprobs | None], offsets: TextOffsets, first_token_text: str = ""
) -> CompletionLogprobs:
    """Logprobs in the legacy completions format, their ``text_offset`` from ``offsets``.

    A ``None`` entry (the first prompt token, which nothing predicts) gets a
    null logprob and null top_logprobs; its text is ``first_token_text``.
    """
    out = CompletionLogprobs()
    for e in entries:
        if e is None:
            token, token_bytes = first_token_text, first_token_text.encode()
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            token, token_bytes = e.chosen.text, e.chosen.token_bytes
            out.token_logprobs.append(clamp_logprob(e.chosen.logprob))
            top = {t.text: clamp_logprob(t.logprob) for t in e.top}
            top.setdefault(token, clamp_logprob(e.chosen.logprob))
            out.top_logprobs.append(top)
        out.tokens.append(token)
        out.text_offset.append(offsets.advance(token_bytes))
    return out
