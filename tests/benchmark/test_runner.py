"""Scheduling a level: Poisson arrivals and a fixed number of requests in flight."""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import time

import pytest

from servelm.benchmark.runner import poisson_arrivals, run_level


def test_poisson_arrivals_mean_gap_is_one_over_rate():
    times = poisson_arrivals(20001, rate=4.0, rng=random.Random(0))
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[0] == 0.0
    assert all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    # exponential: the standard deviation equals the mean
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.05)


def test_poisson_arrivals_are_seeded():
    assert poisson_arrivals(50, 2.0, random.Random(7)) == poisson_arrivals(50, 2.0, random.Random(7))
    assert poisson_arrivals(50, 2.0, random.Random(7)) != poisson_arrivals(50, 2.0, random.Random(8))
    assert poisson_arrivals(5, float("inf"), random.Random(0)) == [0.0] * 5
    with pytest.raises(ValueError):
        poisson_arrivals(5, 0.0, random.Random(0))


class Tracker:
    """A fake send(): counts how many calls are in flight at once."""

    def __init__(self, delay: float = 0.002):
        self.delay = delay
        self.in_flight = 0
        self.most = 0
        self.sent: list[int] = []

    async def send(self, item: int) -> int:
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        self.sent.append(item)
        await asyncio.sleep(self.delay * (1 + item % 3))
        self.in_flight -= 1
        return item * 10


@pytest.mark.parametrize("concurrency", [1, 3, 8])
async def test_fixed_concurrency_never_exceeds_n_in_flight(concurrency):
    tracker = Tracker()
    done = []
    results, duration = await run_level(tracker.send, list(range(30)), concurrency=concurrency, on_result=done.append)
    assert tracker.most == concurrency  # reached, never exceeded
    assert results == [i * 10 for i in range(30)]  # in request order
    assert sorted(tracker.sent) == list(range(30))  # each sent once
    assert sorted(done) == results
    assert duration > 0


async def test_concurrency_above_the_request_count():
    tracker = Tracker()
    results, _ = await run_level(tracker.send, [1, 2], concurrency=64)
    assert results == [10, 20] and tracker.most == 2


async def test_request_rate_paces_arrivals():
    tracker = Tracker(delay=0.0)
    start = time.perf_counter()
    results, duration = await run_level(tracker.send, list(range(10)), request_rate=100.0, rng=random.Random(1))
    expected = poisson_arrivals(10, 100.0, random.Random(1))[-1]
    assert results == [i * 10 for i in range(10)]
    assert duration >= expected * 0.95
    assert time.perf_counter() - start < expected + 1.0


async def test_request_rate_with_a_concurrency_cap():
    tracker = Tracker(delay=0.01)
    results, _ = await run_level(tracker.send, list(range(20)), concurrency=2, request_rate=float("inf"))
    assert tracker.most == 2
    assert results == [i * 10 for i in range(20)]


async def test_level_needs_a_concurrency_or_a_rate():
    with pytest.raises(ValueError):
        await run_level(Tracker().send, [1], concurrency=None, request_rate=None)
    with pytest.raises(ValueError):
        await run_level(Tracker().send, [1], concurrency=0)
