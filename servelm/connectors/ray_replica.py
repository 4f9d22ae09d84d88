"""One engine replica of a Ray Serve deployment: the async engine behind Serve calls.

``EngineReplica`` is a plain class; ``ray_deploy`` turns it into a Serve
deployment. Each replica wraps a :class:`LocalConnector` (the same engine the
in-process server runs) and answers the calls :class:`RayConnector` makes
through a ``DeploymentHandle``.

Errors the client caused cross the process boundary as data (an ``"error"``
item holding the :class:`ConnectorError` fields), not as exceptions: Ray
wraps exceptions in ``RayTaskError`` and a custom constructor does not
survive that. Anything raised instead means the replica itself failed, which
the front end may retry on another replica.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from servelm.engine.outputs import RequestOutput
from servelm.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How often a replica pushes its figures to the stats board (ray_stats.py).
STATS_PERIOD_S = 0.25
# After a request's first output, what its engine delivers within this long of
# the last item sent is held and sent as one item: a Ray object costs about half
# a millisecond of CPU, and a fast engine step delivers one token.
FLUSH_INTERVAL_S = 0.02


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
        self.flush_interval_s = FLUSH_INTERVAL_S
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
        self.connector.load()
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

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[list[RequestOutput] | dict[str, Any]]:
        """Stream one request in chunks: each item is a list of the engine's outputs.

        The first output goes at once (it is the time to first token). After
        it, what the engine delivers within ``flush_interval_s`` of the last
        item sent is held and sent together: at most one Ray object per
        request per interval however short the engine's steps, and no token
        waits longer than the interval. The request's end or an error goes at
        once, with whatever was held. Items carry the prompt's token ids only
        in the first output. Cancelling the stream (the client left) aborts
        the request here.
        """
        params: SamplingParams = request["params"]
        stream = self.connector.generate(request["model"], request["request_id"], request["prompt"], params)
        queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for out in stream:
                    queue.put_nowait(out)
                queue.put_nowait(None)
            except BaseException as exc:
                queue.put_nowait(exc)

        task = asyncio.create_task(pump())
        loop = asyncio.get_running_loop()
        sent_at: float | None = None  # loop time of the last item sent
        try:
            while True:
                items = [await queue.get()]
                if sent_at is not None:
                    await _gather_until(queue, items, sent_at + self.flush_interval_s)
                while not queue.empty():
                    items.append(queue.get_nowait())
                chunk: list[RequestOutput] = []
                for it in items:
                    if it is None:
                        break
                    if isinstance(it, ConnectorError):
                        if chunk:
                            yield chunk
                        yield error_item(it)
                        return
                    if isinstance(it, BaseException):
                        raise it
                    if sent_at is not None or chunk:
                        it.prompt_token_ids = []
                    chunk.append(it)
                if chunk:
                    yield chunk
                    sent_at = loop.time()
                if any(it is None for it in items):
                    return
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):  # cancelled on purpose
                await task
            await stream.aclose()  # type: ignore[attr-defined]  # an async generator

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


def _ends_stream(item: RequestOutput | BaseException | None) -> bool:
    return item is None or isinstance(item, BaseException) or item.finished


async def _gather_until(queue: asyncio.Queue, items: list, deadline: float) -> None:
    """Append what arrives on ``queue`` to ``items`` until ``deadline`` (loop time) or the stream's end."""
    while not _ends_stream(items[-1]):
        try:
            async with asyncio.timeout_at(deadline):
                items.append(await queue.get())
        except TimeoutError:
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
