"""Running torch work outside the engine's thread in threads that end with it.

A thread that runs a parallel torch op on the CPU gets an OpenMP team of
worker threads, and keeps it for as long as the thread lives. libgomp counts
the threads of every team, and once they outnumber the cores, each worker
waits for the next parallel region by sleeping instead of spinning
(``gomp_throttled_spin_count_var``). The engine's decoding step is a few
hundred parallel regions, so its workers then pay a kernel wake-up per
kernel: on the 2-core dev VM a server that had answered one
``/v1/embeddings`` request decoded at 12.7 ms a token instead of 8.8, for
the rest of its life, and a Ray replica that loaded its model on Serve's
thread at 14.3 instead of 11.4 (docs/BENCHMARKS.md, "Scale-out on Ray
Serve"). A thread that ends frees its team, so torch work off the engine's
thread (loading, an embedding batch) runs in one: starting a thread costs
tens of microseconds, less than any such work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def _start(fn: Callable[[], T], name: str) -> tuple[threading.Thread, concurrent.futures.Future[T]]:
    """A new thread running ``fn()``, and the future of its result."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to the caller
            future.set_exception(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, future


def run_in_passing_thread(fn: Callable[[], T], name: str = "servelm-passing") -> T:
    """``fn()`` in a new thread, waited for until it has ended; returns its result or raises what it raised."""
    thread, future = _start(fn, name)
    thread.join()
    return future.result()


async def in_passing_thread(fn: Callable[[], T], name: str = "servelm-passing") -> T:
    """``await``-able :func:`run_in_passing_thread`: the event loop runs on meanwhile.

    Cancelling the caller does not stop ``fn`` (no thread can be stopped);
    its result is then dropped, as with :func:`asyncio.to_thread`.
    """
    _thread, future = _start(fn, name)
    return await asyncio.wrap_future(future)
