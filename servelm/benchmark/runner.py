"""Sending a level's requests: a fixed number in flight, or Poisson arrivals.

``--concurrency N`` alone is a closed loop: N workers, each sending its next
request as soon as the previous one ends. ``--request-rate R`` is an open
loop: requests arrive at random (exponential gaps, mean 1/R seconds) whether
or not earlier ones have finished; a concurrency then caps how many are in
flight, and the rest wait for a free slot.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

R = TypeVar("R")
Q = TypeVar("Q")


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """Send times of ``n`` requests (seconds from the start) of a Poisson process of ``rate`` per second.

    The first request goes at 0; each gap after it is exponential with mean
    ``1 / rate``. An infinite rate sends everything at once.
    """
    if rate <= 0:
        raise ValueError("the request rate must be positive")
    times = [0.0] * n
    for i in range(1, n):
        gap = 0.0 if rate == float("inf") else rng.expovariate(rate)
        times[i] = times[i - 1] + gap
    return times


async def run_level(
    send: Callable[[Q], Awaitable[R]],
    requests: Sequence[Q],
    *,
    concurrency: int | None = None,
    request_rate: float | None = None,
    rng: random.Random | None = None,
    on_result: Callable[[R], None] | None = None,
) -> tuple[list[R], float]:
    """Send every request with ``send``; returns the results in request order and the wall time.

    ``send`` must not raise (the client turns failures into results).
    ``on_result`` is called as each request ends (the progress bar).
    """
    if request_rate is None and concurrency is None:
        raise ValueError("give a concurrency, a request rate or both")
    if concurrency is not None and concurrency < 1:
        raise ValueError("the concurrency must be at least 1")
    results: list[R | None] = [None] * len(requests)

    async def one(i: int) -> None:
        result = await send(requests[i])
        results[i] = result
        if on_result is not None:
            on_result(result)

    start = time.perf_counter()
    if request_rate is None:
        assert concurrency is not None
        indices = iter(range(len(requests)))

        async def worker() -> None:
            for i in indices:  # a shared iterator: each index goes to exactly one worker
                await one(i)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
    else:
        arrivals = poisson_arrivals(len(requests), request_rate, rng or random.Random())
        slots = asyncio.Semaphore(concurrency) if concurrency is not None else None

        async def capped(i: int) -> None:
            if slots is None:
                await one(i)
                return
            async with slots:
                await one(i)

        tasks = []
        for i, at in enumerate(arrivals):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(capped(i)))
        await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    return [r for r in results if r is not None], duration
