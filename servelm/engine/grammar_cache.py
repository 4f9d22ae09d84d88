"""Compiled grammars by key: each compiled once, shared by every request that names it.

Thread-safe: requests compile in worker threads (never on the engine loop),
and two requests naming the same grammar at once share one compile, the
second waiting for the first. A failed compile is not kept, so the error is
raised to each request that asks (compiling a bad spec fails fast). Least
recently used entries go once ``max_entries`` is reached.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class GrammarCacheStats:
    """How the cache has been used: lookups that found a grammar, compiles, and their total time."""

    hits: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0


class GrammarCache(Generic[T]):
    """Keys to compiled values, computed by ``compile(key)`` at most once per key while cached."""

    def __init__(self, compile: Callable[[Hashable], T], max_entries: int = 256):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self._compile = compile
        self._max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, Future[T]] = OrderedDict()
        self.stats = GrammarCacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def peek(self, key: Hashable) -> T | None:
        """The compiled value if it is ready, else None; never waits, never compiles."""
        with self._lock:
            future = self._entries.get(key)
            if future is None or not future.done() or future.exception() is not None:
                return None
            self._entries.move_to_end(key)
            self.stats.hits += 1
        return future.result()

    def get(self, key: Hashable) -> T:
        """The compiled value for ``key``: cached, being compiled by another thread (waits), or compiled here.

        Raises what ``compile`` raised.
        """
        with self._lock:
            future = self._entries.get(key)
            owner = future is None
            if owner:
                future = self._entries[key] = Future()
                while len(self._entries) > self._max_entries:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(key)
                self.stats.hits += 1
        assert future is not None
        if not owner:
            return future.result()
        start = time.perf_counter()
        try:
            value = self._compile(key)
        except BaseException as exc:
            with self._lock:
                if self._entries.get(key) is future:
                    del self._entries[key]
            future.set_exception(exc)
            raise
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds += time.perf_counter() - start
        future.set_result(value)
        return value
