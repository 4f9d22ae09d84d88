"""One engine replica of a Ray Serve deployment: the async engine behind Serve calls.

``EngineReplica`` is a plain class; ``ray_deploy`` turns it into a Serve
deployment. Each replica wraps a :class:`LocalConnector` (the same engine the
in-process server runs) and answers the calls :class:`RayConnector` makes
through a ``DeploymentHandle``.

Outputs do not travel in each request's own Serve stream: a Ray object costs
about half a millisecond of CPU, and one per request per engine step is a
large share of a step. Each front end opens one :meth:`EngineReplica.channel`
per replica, and every engine step's outputs of all its requests there go
back as one object (``ray_channel.py`` is the front end's side).

Errors the client caused cross the process boundary as data (an ``"error"``
item holding the :class:`ConnectorError` fields), not as exceptions: Ray
wraps exceptions in ``RayTaskError`` and a custom constructor does not
survive that. Anything raised instead means the replica itself failed, which
the front end may retry on another replica.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from servelm.connectors.base import ConnectorError
from servelm.connectors.local import LocalConnector
from servelm.engine.config import EngineConfig
from servelm.engine.sampling_params import SamplingParams
from servelm.platform.threads import run_in_passing_thread

logger = logging.getLogger(__name__)

# How often a replica pushes its figures to the stats board (ray_stats.py).
STATS_PERIOD_S = 0.25
# An outbox no channel has read for this long belongs to a front end that is gone.
STALE_OUTBOX_S = 60.0
# A channel with no request of its front end on the replica for this long ends.
CHANNEL_IDLE_S = 10.0
# Loop turns a channel waits, at most, for the rest of an engine step's outputs.
SETTLE_TURNS = 8


def error_item(exc: ConnectorError) -> dict[str, Any]:
    """A ConnectorError as plain data, for the trip back to the front end."""
    return {
        "error": {
            "message": exc.message,
            "status": exc.status,
            "type": exc.type,
            "code": exc.code,
            "param": exc.param,
        }
    }


def raise_error_item(item: Any) -> None:
    """Re-raise an :func:`error_item` as a ConnectorError (no-op for anything else)."""
    if isinstance(item, dict) and "error" in item:
        e = item["error"]
        raise ConnectorError(e["message"], status=e["status"], type=e["type"], code=e["code"], param=e["param"])


class EngineReplica:
    """A Serve replica holding one engine (and the embedding encoder, when configured).

    ``spec`` is a plain dict from :func:`servelm.connectors.ray_deploy.replica_spec`.
    """

    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        self.replica_id = _replica_id()
        self.node_id, self.node_ip = _node()
        self.pid = os.getpid()
        self._outboxes: dict[str, Outbox] = {}  # front end channel id -> what it has still to send
        self.channel_idle_s = CHANNEL_IDLE_S
        threads = spec.get("threads")
        if threads:
            # The cores Ray reserved for this replica, not every core of the
            # node: replicas sharing a node would otherwise oversubscribe it.
            import torch

            torch.set_num_threads(threads)
        self.connector = LocalConnector(
            spec["model"],
            spec.get("embedding_model"),
            EngineConfig(**spec["engine"]),
            served_model_name=spec.get("served_model_name"),
        )
        # Not on Serve's thread, which lives on: see servelm/platform/threads.py.
        run_in_passing_thread(self.connector.load, name="servelm-load")
        self.started = time.time()
        self._stats_name: str | None = spec.get("stats_board")
        self._stop = threading.Event()
        if self._stats_name:
            threading.Thread(target=self._push_stats, name="servelm-stats", daemon=True).start()

    # -- Serve hooks ---------------------------------------------------

    def check_health(self) -> None:
        """Serve's health check: a dead engine loop restarts this replica."""
        engine = self.connector.engine
        if engine is not None and not engine.is_alive:
            raise RuntimeError(f"the engine loop died: {engine.dead_error!r}")

    def record_routing_stats(self) -> dict[str, Any]:
        """Load figures for Serve's request router (polled by the controller)."""
        stats = self._stats()
        return {"running": stats["running"], "waiting": stats["waiting"], "kv_cache_usage": stats["kv_cache_usage"]}

    # -- generation ----------------------------------------------------

    async def channel(self, target: dict[str, Any]) -> AsyncIterator[list[tuple[str, Any]] | dict[str, Any]]:
        """One front end's channel from this replica: its requests' outputs, one item per engine step.

        ``target`` is ``{"channel": front end's id, "pin": this replica's id}``
        (the router sends the call to the pinned replica). The first item is
        ``{"replica": id}`` (the channel is open); then each item is a list of
        ``(request_id, output or error item)`` pairs: what the front end's
        requests here delivered since the last item, which is one engine
        step's outputs for all of them. One Ray object per step however many
        requests run, not one per request per step. A channel with no
        request of its front end here for ``channel_idle_s`` ends, so that
        one whose front end is gone stops counting as an ongoing request
        (Serve's autoscaling and graceful shutdown wait on those).
        """
        box = self._outbox(target["channel"])
        box.subscribed = True
        try:
            yield {"replica": self.replica_id}
            while True:
                try:
                    async with asyncio.timeout(self.channel_idle_s):
                        await box.ready.wait()
                except TimeoutError:
                    if box.users == 0:
                        return  # the front end reopens it with its next request here
                    continue
                await _settle(box)
                yield box.take()
        finally:
            box.subscribed = False
            if self._outboxes.get(target["channel"]) is box:
                del self._outboxes[target["channel"]]

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Run one request; its outputs go out on its front end's :meth:`channel`.

        This stream carries only ``{"replica": id}``, so the front end knows
        which channel to read, and ends when the request does: it is how
        Serve routes, counts and cancels the request, and how the front end
        sees this replica die. The prompt's token ids travel only in the
        first output; a request's error travels as an :func:`error_item`
        after its outputs. Cancelling the stream (the client left) aborts
        the request here.
        """
        box = self._outbox(request["channel"])
        box.users += 1
        rid = request["request_id"]
        params: SamplingParams = request["params"]
        stream = self.connector.generate(request["model"], rid, request["prompt"], params)
        try:
            yield {"replica": self.replica_id}
            first = True
            async for out in stream:
                if not first:
                    out.prompt_token_ids = []
                first = False
                box.put(rid, out)
        except ConnectorError as exc:
            box.put(rid, error_item(exc))
        finally:
            box.users -= 1
            await stream.aclose()  # type: ignore[attr-defined]  # an async generator

    def _outbox(self, channel: str) -> Outbox:
        """The outbox of a front end's channel; boxes nobody read for ``STALE_OUTBOX_S`` are dropped."""
        box = self._outboxes.get(channel)
        if box is None:
            now = time.monotonic()
            for key in [
                k
                for k, b in self._outboxes.items()
                if not (b.subscribed or b.users) and now - b.touched > STALE_OUTBOX_S
            ]:
                del self._outboxes[key]  # a front end that went away before it opened its channel
            box = self._outboxes[channel] = Outbox()
        return box

    # -- everything else -----------------------------------------------

    async def call(self, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Run one Connector method; returns ``{"ok": value}`` or an :func:`error_item`."""
        if method not in _CALLS:
            raise ValueError(f"unknown replica call {method!r}")
        try:
            return {"ok": await getattr(self.connector, method)(*args, **kwargs)}
        except ConnectorError as exc:
            return error_item(exc)

    async def info(self) -> dict[str, Any]:
        """Who this replica is and how busy: for /v1/replicas and the metrics."""
        return self._stats()

    def _stats(self) -> dict[str, Any]:
        engine = self.connector.engine
        # Read before the figures, so that every request listed is counted in them.
        held = sorted(engine.request_ids()) if engine is not None else []
        stats = [asdict(s) for s in _sync(self.connector.engine_stats())]
        depth = _sync(self.connector.queue_depth())
        alive = engine is None or engine.is_alive
        return {
            "replica": self.replica_id,
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "pid": self.pid,
            "state": "RUNNING" if alive else "DEAD",
            "started": self.started,
            "time": time.time(),
            "running": depth.running,
            "waiting": depth.waiting,
            "kv_cache_usage": stats[0]["kv_cache_usage"] if stats else 0.0,
            "engines": stats,
            "request_ids": held,
        }

    # -- the stats push ------------------------------------------------

    def _push_stats(self) -> None:
        # Pushed rather than polled: the front end cannot address one replica
        # through a DeploymentHandle, but every replica can find the board.
        # A thread, so reports go on while the event loop is busy streaming.
        import ray

        from servelm.connectors.ray_stats import stats_board

        board = None
        while not self._stop.is_set():
            try:
                if board is None:
                    board = stats_board(str(self._stats_name), self.spec["namespace"])
                ray.get(board.put.remote(self._stats()), timeout=5.0)
            except Exception:
                board = None
            self._stop.wait(STATS_PERIOD_S)

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        connector = getattr(self, "connector", None)
        if connector is not None:
            connector.shutdown()


# The Connector methods a front end may run on a replica through ``call``.
_CALLS = frozenset({"models", "embed", "tokenize", "detokenize", "apply_chat_template"})


def _sync(coro):
    # LocalConnector's engine_stats/queue_depth are async only for the
    # protocol's sake: they never await, so one send() runs them to the end.
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("expected a coroutine that does not suspend")


class Outbox:
    """What one front end's channel has still to send from this replica."""

    def __init__(self) -> None:
        self.items: list[tuple[str, Any]] = []
        self.ready = asyncio.Event()
        self.subscribed = False
        self.users = 0  # requests of the front end running here
        self.touched = time.monotonic()

    def put(self, request_id: str, item: Any) -> None:
        self.items.append((request_id, item))
        self.ready.set()

    def take(self) -> list[tuple[str, Any]]:
        items, self.items = self.items, []
        self.ready.clear()
        self.touched = time.monotonic()
        return items


async def _settle(box: Outbox) -> None:
    """Let the rest of an engine step's outputs into ``box``: the engine thread hands each request's
    output to the loop separately, so they may take a few turns of the loop to arrive."""
    for _ in range(SETTLE_TURNS):
        count = len(box.items)
        await asyncio.sleep(0)
        if len(box.items) == count:
            return


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return f"pid-{os.getpid()}"


def _node() -> tuple[str, str]:
    try:
        import ray

        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address()
    except Exception:
        return "local", "127.0.0.1"
