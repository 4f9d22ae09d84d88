"""The grammar cache alone, with a stand-in compile function: once per key, shared waits, failures not kept."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from servelm.engine.grammar_cache import GrammarCache


class Compiles:
    """A compile function that records its calls and can be held until released."""

    def __init__(self, fail: set[str] = frozenset()):
        self.calls: list[str] = []
        self.fail = set(fail)
        self.started = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def __call__(self, key):
        self.calls.append(key)
        self.started.set()
        assert self.release.wait(60)
        if key in self.fail:
            raise ValueError(f"bad {key}")
        return f"compiled {key}"


def test_each_key_compiles_once():
    compile = Compiles()
    cache = GrammarCache(compile)
    assert cache.peek("a") is None
    assert cache.get("a") == "compiled a"
    assert cache.get("a") == "compiled a" and cache.peek("a") == "compiled a"
    assert cache.get("b") == "compiled b"
    assert compile.calls == ["a", "b"]
    assert (cache.stats.compiles, cache.stats.hits) == (2, 2)


def test_concurrent_requests_for_one_key_share_one_compile():
    compile = Compiles()
    compile.release.clear()
    cache = GrammarCache(compile)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(cache.get, "k")
        assert compile.started.wait(60)
        assert cache.peek("k") is None  # still compiling: peek never waits
        others = [pool.submit(cache.get, "k") for _ in range(3)]
        compile.release.set()
        results = [first.result(60)] + [f.result(60) for f in others]
    assert results == ["compiled k"] * 4
    assert compile.calls == ["k"]


def test_a_failure_reaches_every_waiter_and_is_not_kept():
    compile = Compiles(fail={"bad"})
    compile.release.clear()
    cache = GrammarCache(compile)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(cache.get, "bad")
        assert compile.started.wait(60)
        second = pool.submit(cache.get, "bad")
        compile.release.set()
        for future in (first, second):
            with pytest.raises(ValueError, match="bad bad"):
                future.result(60)
    assert len(cache) == 0 and cache.peek("bad") is None
    with pytest.raises(ValueError):
        cache.get("bad")
    assert compile.calls == ["bad", "bad"]  # asked again after the failure: compiled again


def test_the_least_recently_used_entry_goes_first():
    compile = Compiles()
    cache = GrammarCache(compile, max_entries=2)
    cache.get("a")
    cache.get("b")
    cache.get("a")  # a is now the most recent
    cache.get("c")  # evicts b
    assert len(cache) == 2 and cache.peek("b") is None and cache.peek("a") == "compiled a"
    cache.get("b")
    assert compile.calls == ["a", "b", "c", "b"]


def test_max_entries_must_be_positive():
    with pytest.raises(ValueError):
        GrammarCache(Compiles(), max_entries=0)
