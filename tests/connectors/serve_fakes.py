"""Ray Serve's transport, in memory: real ``EngineReplica`` streams behind a handle-like object.

``ServeStream`` runs a replica's async generator in its own task, as a
Serve replica does, so that ``cancel()`` cancels it mid-await (what Serve
does when the front end cancels a call); ``Handle`` sends ``generate`` to
the replicas in turn and ``channel`` to the replica it pins. The replicas
are real ``EngineReplica`` objects with a scripted engine, so the front end
and replica code under test is the code that runs on Ray.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Coroutine, Generator
from types import SimpleNamespace
from typing import Any

from servelm.connectors.ray_replica import CHANNEL_IDLE_S, EngineReplica

_END = object()


class ServeStream:
    """A streaming call's response: the replica's items in order, an exception if it raised."""

    def __init__(self, items: AsyncIterator[Any]):
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run(items))

    async def _run(self, items: AsyncIterator[Any]) -> None:
        try:
            async for item in items:
                self._queue.put_nowait(item)
            self._queue.put_nowait(_END)
        except asyncio.CancelledError:
            self._queue.put_nowait(_END)
            raise
        except Exception as exc:
            self._queue.put_nowait(exc)

    def __aiter__(self) -> ServeStream:
        return self

    async def __anext__(self) -> Any:
        item = await self._queue.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self) -> None:
        self._task.cancel()

    def kill(self, exc: Exception) -> None:
        """The replica died: the stream stops with ``exc`` (Ray's ActorDiedError, say)."""
        self._task.cancel()
        self._queue.put_nowait(exc)


class ServeCall:
    """A unary call's response, as Serve's: awaitable, and ``cancel()`` cancels it on the replica."""

    def __init__(self, call: Coroutine[Any, Any, Any]):
        self._task = asyncio.ensure_future(call)

    def __await__(self) -> Generator[Any, None, Any]:
        return asyncio.shield(self._task).__await__()  # as Serve: the caller's cancellation stays the caller's

    def cancel(self) -> None:
        self._task.cancel()


class StandInEngine:
    """Base of the scripted engines a test puts in a replica (the replica's connector)."""

    def shutdown(self) -> None:
        """Called when the replica is collected; nothing to stop."""


def replica(engine: Any, replica_id: str = "a") -> EngineReplica:
    """An ``EngineReplica`` around ``engine`` (a stand-in connector), without loading a model."""
    r = EngineReplica.__new__(EngineReplica)
    r.connector = engine
    r.replica_id = replica_id
    r._outboxes = {}
    r.channel_idle_s = CHANNEL_IDLE_S
    return r


class Handle:
    """A ``DeploymentHandle`` stand-in over in-memory replicas.

    ``generate`` goes to the replicas in turn; ``channel`` to its pinned
    replica; ``call`` answers with ``answers[method]``. Every stream opened
    is kept, per replica, so a test can kill them.
    """

    def __init__(self, replicas: list[EngineReplica], answers: dict[str, Any] | None = None):
        self.replicas = {r.replica_id: r for r in replicas}
        self.answers = answers or {}
        self.generated: list[dict[str, Any]] = []
        self.streams: dict[str, list[ServeStream]] = {r.replica_id: [] for r in replicas}
        self._turn = itertools.cycle(list(self.replicas))
        self.call = SimpleNamespace(remote=self._call)
        self.generate = SimpleNamespace(remote=self._generate)
        self.channel = SimpleNamespace(remote=self._channel)

    def options(self, **_: Any) -> Handle:
        return self

    def _call(self, method: str, *args: Any, **kwargs: Any) -> ServeCall:
        """``answers[method]``: the answer, or an async function of the call's arguments that makes it."""
        answer = self.answers[method]

        async def run() -> dict[str, Any]:
            return {"ok": await answer(*args, **kwargs) if callable(answer) else answer}

        return ServeCall(run())

    def _stream(self, replica_id: str, items: AsyncIterator[Any]) -> ServeStream:
        stream = ServeStream(items)
        self.streams[replica_id].append(stream)
        return stream

    def _generate(self, request: dict[str, Any]) -> ServeStream:
        self.generated.append(request)
        replica_id = next(self._turn)
        return self._stream(replica_id, self.replicas[replica_id].generate(request))

    def _channel(self, target: dict[str, Any]) -> ServeStream:
        return self._stream(target["pin"], self.replicas[target["pin"]].channel(target))

    def kill(self, replica_id: str, exc: Exception) -> None:
        """Every stream of ``replica_id`` stops with ``exc``, and it gets no more calls."""
        for stream in self.streams[replica_id]:
            stream.kill(exc)
        self._turn = itertools.cycle([r for r in self.replicas if r != replica_id])
