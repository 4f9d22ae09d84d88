"""Logprobs in OpenAI's two formats: chat's per-token entries and the legacy completions lists."""

from __future__ import annotations

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
            bytes=list(e.chosen.text.encode("utf-8")),
            top_logprobs=[
                ChatLogprobTop(token=t.text, logprob=clamp_logprob(t.logprob), bytes=list(t.text.encode("utf-8")))
                for t in e.top
            ],
        )
        for e in entries
    ]


def legacy_logprobs(
    entries: list[PositionLogprobs | None], text_offset: int, first_token_text: str = ""
) -> CompletionLogprobs:
    """Logprobs in the legacy completions format, offsets counted from ``text_offset``.

    A ``None`` entry (the first prompt token, which nothing predicts) gets a
    null logprob and null top_logprobs; its text is ``first_token_text``.
    """
    out = CompletionLogprobs()
    offset = text_offset
    for e in entries:
        if e is None:
            token = first_token_text
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            token = e.chosen.text
            out.token_logprobs.append(clamp_logprob(e.chosen.logprob))
            top = {t.text: clamp_logprob(t.logprob) for t in e.top}
            top.setdefault(token, clamp_logprob(e.chosen.logprob))
            out.top_logprobs.append(top)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
    return out
