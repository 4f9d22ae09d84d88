"""Running text work (tokenizing, chat templates, detokenizing) off the event loop when it is big.

A 10 MB prompt takes seconds to tokenize; done on the event loop it would
freeze every other request, ``/ping`` included. Small inputs stay on the
loop: a thread hop costs tens of microseconds plus a wait for a free worker,
which is what short requests would pay in latency for nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# Characters (or token ids) above which the work runs in a worker thread.
# Tokenizing this much text takes well under a millisecond.
OFF_LOOP_SIZE = 4096


async def run_sized(size: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``: in a worker thread when ``size`` exceeds :data:`OFF_LOOP_SIZE`, else inline."""
    if size > OFF_LOOP_SIZE:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def text_size(value: Any) -> int:
    """Characters of text in a JSON-like value (chat messages): how big rendering it is."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_size(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_size(v) for v in value)
    return 0
