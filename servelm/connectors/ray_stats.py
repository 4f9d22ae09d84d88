"""The deployment's figures: replicas push theirs to a board, the front end reads it.

A ``DeploymentHandle`` routes each call to one replica of the router's
choosing, so the front end cannot ask every replica in turn. Instead each
replica pushes a snapshot (running, waiting, KV usage, prefix-cache totals,
pid, node) to a small named actor, the :class:`StatsBoard`, every
``STATS_PERIOD_S``; the front end polls the board and keeps the last
snapshot, so ``queue_depth()`` (called before every request) never waits on
Ray. A replica that stops reporting for ``STALE_AFTER_S`` counts as down.
Ages are measured on the board's clock and then the front end's, never
across the two: machines' clocks may disagree by more than that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from servelm.connectors.base import QueueDepth, ReplicaStatus
from servelm.engine.outputs import EngineStats

logger = logging.getLogger(__name__)

# A replica silent this long is down (it pushes every 0.25 s).
STALE_AFTER_S = 3.0
# Entries of replicas gone this long are dropped from the board.
FORGET_AFTER_S = 60.0
POLL_PERIOD_S = 0.25


class StatsBoard:
    """A Ray actor holding each replica's latest snapshot (see the module docstring)."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, Any]] = {}

    def put(self, snapshot: dict[str, Any]) -> None:
        snapshot["received"] = time.monotonic()
        self.entries[snapshot["replica"]] = snapshot

    def get(self) -> list[dict[str, Any]]:
        """The snapshots, each with its ``age``: seconds since the board received it."""
        now = time.monotonic()
        for key in [k for k, v in self.entries.items() if now - v["received"] > FORGET_AFTER_S]:
            del self.entries[key]
        return [dict(v, age=now - v["received"]) for v in self.entries.values()]


def stats_board(name: str, namespace: str):
    """The board's actor handle, created by whoever asks first (a replica, or ``serve deploy``'d ones)."""
    import ray

    cls = ray.remote(num_cpus=0)(StatsBoard)
    return cls.options(name=name, namespace=namespace, lifetime="detached", get_if_exists=True).remote()


@dataclass
class DeploymentStats:
    """The front end's view of the replicas, from the board's last snapshot."""

    snapshots: list[dict[str, Any]] = field(default_factory=list)
    read_at: float = field(default_factory=time.monotonic)  # when the board was read (this clock)

    def age(self, snapshot: dict[str, Any]) -> float:
        """Seconds since the board received ``snapshot``: its age at the read, plus the time since."""
        return snapshot["age"] + time.monotonic() - self.read_at

    def live(self) -> list[dict[str, Any]]:
        """Snapshots of replicas that reported recently and whose engine runs."""
        return [s for s in self.snapshots if self.age(s) <= STALE_AFTER_S and s["state"] == "RUNNING"]

    def queue_depth(self) -> QueueDepth:
        """Running and waiting requests summed over the live replicas (the whole cluster's queue)."""
        live = self.live()
        return QueueDepth(running=sum(s["running"] for s in live), waiting=sum(s["waiting"] for s in live))

    def request_ids(self) -> set[str]:
        """The requests the live replicas' engines held when they last reported."""
        return {rid for s in self.live() for rid in s.get("request_ids", ())}

    def engine_stats(self) -> list[EngineStats]:
        """Each live replica's engine figures (``replica`` set) and, per model, their sum (``replica`` None)."""
        per_replica: list[EngineStats] = []
        for s in sorted(self.live(), key=lambda s: s["replica"]):
            for e in s["engines"]:
                per_replica.append(EngineStats(**{**e, "replica": s["replica"]}))
        totals: dict[str, EngineStats] = {}
        counts: dict[str, int] = {}
        for e in per_replica:
            t = totals.get(e.model)
            counts[e.model] = counts.get(e.model, 0) + 1
            if t is None:
                totals[e.model] = EngineStats(**{**e.__dict__, "replica": None})
                continue
            totals[e.model] = EngineStats(
                model=e.model,
                num_running=t.num_running + e.num_running,
                num_waiting=t.num_waiting + e.num_waiting,
                # Usage is a fraction: the sum's is the mean over replicas of one size.
                kv_cache_usage=t.kv_cache_usage + e.kv_cache_usage,
                prefix_cache_queries=t.prefix_cache_queries + e.prefix_cache_queries,
                prefix_cache_hits=t.prefix_cache_hits + e.prefix_cache_hits,
                num_preemptions=t.num_preemptions + e.num_preemptions,
                spec_decode_drafts=t.spec_decode_drafts + e.spec_decode_drafts,
                spec_decode_draft_tokens=t.spec_decode_draft_tokens + e.spec_decode_draft_tokens,
                spec_decode_accepted_tokens=t.spec_decode_accepted_tokens + e.spec_decode_accepted_tokens,
                dtype=e.dtype,
                device=e.device,
                kv_cache_tokens=t.kv_cache_tokens + e.kv_cache_tokens,
                kv_cache_bytes=t.kv_cache_bytes + e.kv_cache_bytes,
            )
        for model, t in totals.items():
            totals[model] = EngineStats(**{**t.__dict__, "kv_cache_usage": t.kv_cache_usage / counts[model]})
        return list(totals.values()) + per_replica

    def replicas(self) -> list[ReplicaStatus]:
        """Every replica the board knows, with its state (RUNNING, DEAD or UNRESPONSIVE)."""
        out = []
        for s in sorted(self.snapshots, key=lambda s: s["replica"]):
            age = self.age(s)
            state = s["state"] if age <= STALE_AFTER_S else "UNRESPONSIVE"
            out.append(
                ReplicaStatus(
                    replica=s["replica"],
                    state=state,
                    node=s["node_ip"],
                    node_id=s["node_id"],
                    pid=s["pid"],
                    running=s["running"],
                    waiting=s["waiting"],
                    kv_cache_usage=s["kv_cache_usage"],
                    last_report_s=round(age, 3),
                )
            )
        return out


class StatsPoller:
    """Polls the board in the background and keeps :class:`DeploymentStats` current.

    ``read`` is an async callable returning the board's entries (a Ray call
    in production, a plain function in tests).
    """

    def __init__(self, read: Callable[[], Any], period_s: float = POLL_PERIOD_S):
        self.read = read
        self.period_s = period_s
        self.stats = DeploymentStats()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def refresh(self) -> DeploymentStats:
        """Read the board now (also what the background task does each period)."""
        try:
            snapshots = await self.read()
        except Exception as exc:
            logger.debug("reading the stats board failed: %s", exc)
            return self.stats
        self.stats = DeploymentStats(snapshots=snapshots, read_at=time.monotonic())
        return self.stats

    async def _run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.period_s)

    async def stop(self) -> None:
        task = self._task
        self.cancel()
        if task is not None:
            with contextlib.suppress(BaseException):  # cancelled on purpose
                await task

    def cancel(self) -> None:
        """Stop the background reads; callable from any thread, also once the loop has ended."""
        task, self._task = self._task, None
        if task is not None and not task.done() and not task.get_loop().is_closed():
            task.get_loop().call_soon_threadsafe(task.cancel)
