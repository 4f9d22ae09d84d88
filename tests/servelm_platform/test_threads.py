"""servelm.platform.threads: torch work off the engine's thread leaves no OpenMP team behind.

A thread that keeps an OpenMP team makes the engine's own team sleep between
kernels (see the module's docstring). The checks run in a fresh interpreter
with two intra-op threads, where the only threads not started by Python are
OpenMP's workers (and the embedding model's tokenizer's pool, started before
the count).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest

from servelm.platform.threads import in_passing_thread, run_in_passing_thread

_TEAMS = """
import asyncio, json, os, sys, threading, time, torch
from servelm.platform.threads import in_passing_thread

torch.set_num_threads(2)

def workers():  # threads not started by Python: OpenMP's
    python = {t.native_id for t in threading.enumerate()}
    return sum(1 for t in os.listdir("/proc/self/task") if int(t) not in python)

def parallel_work():
    x = torch.ones(1 << 22)
    for _ in range(4):
        x.add_(1)  # an at::parallel_for over 4M elements: runs on an OpenMP team

async def main(how):
    if how == "passing":
        await in_passing_thread(parallel_work)
    elif how == "to_thread":
        await asyncio.to_thread(parallel_work)
    else:  # an embedding batch through the connector
        from servelm.connectors.local import LocalConnector
        conn = LocalConnector(None, "all-minilm-l6-v2")
        conn.load()  # on this thread, which lives on: its team is counted in `warm`, not left to exit later
        texts = ["a sentence to embed " * 20] * 8
        conn.embedder.tokenizer(texts)  # the tokenizer's own thread pool (Rust's), started once
        warm = workers()
        await conn.embed("all-minilm-l6-v2", texts)
        return warm
    return 0

async def run(how):
    before = workers()
    warm = await main(how)
    # A freed team's workers exit on their own: wait (bounded) for the count to come back.
    deadline = time.monotonic() + float(sys.argv[2])
    while workers() > max(before, warm) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return {"before": max(before, warm), "after": workers()}

print(json.dumps(asyncio.run(run(sys.argv[1]))))
"""


def _teams(how: str, wait_s: float = 120.0) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _TEAMS, how, str(wait_s)], capture_output=True, text=True, timeout=600, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_work_in_a_passing_thread_leaves_no_openmp_team():
    counts = _teams("passing")
    assert counts["after"] == counts["before"], counts


def test_asyncios_worker_thread_keeps_its_team_which_is_why_servelm_avoids_it():
    # The control: the same work through asyncio.to_thread leaves the worker's team alive for good,
    # so a short look suffices (the count never comes back however long one waits).
    counts = _teams("to_thread", wait_s=1.0)
    assert counts["after"] > counts["before"], counts


@pytest.mark.model
def test_an_embedding_request_leaves_no_openmp_team():
    counts = _teams("embed")
    assert counts["after"] == counts["before"], counts


def test_results_and_errors_come_back_to_the_caller():
    seen: list[str] = []

    def work() -> int:
        seen.append(threading.current_thread().name)
        return 7

    assert run_in_passing_thread(work, name="t-sync") == 7
    assert asyncio.run(in_passing_thread(work, name="t-async")) == 7
    assert seen == ["t-sync", "t-async"]

    def fail() -> None:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        run_in_passing_thread(fail)
    with pytest.raises(ValueError, match="bad input"):
        asyncio.run(in_passing_thread(fail))


def test_a_cancelled_caller_leaves_the_loop_without_errors():
    release = threading.Event()
    errors: list[dict] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        task = asyncio.create_task(in_passing_thread(release.wait, name="t-cancel"))
        await asyncio.sleep(0)
        (thread,) = [t for t in threading.enumerate() if t.name == "t-cancel"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()  # the work ends after its caller has gone
        await asyncio.to_thread(thread.join)
        for _ in range(3):
            await asyncio.sleep(0)  # the thread's hand-back runs on the loop

    asyncio.run(main())
    assert errors == []
