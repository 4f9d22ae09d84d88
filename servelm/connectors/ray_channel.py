"""The front end's side of the replicas' channels: each request's outputs, whichever replica runs it.

A request runs on a replica as a Serve stream that says only where it runs
(``{"replica": id}``) and ends with the request; its outputs come on the
front end's one channel from that replica (``EngineReplica.channel``), which
carries every engine step's outputs of all this front end's requests there
as one item. :class:`Channels` opens a channel the first time a request
lands on a replica, reads it, and hands each output to its request's
mailbox. When a channel ends or fails, every request on that replica gets
:class:`ReplicaFailed` and is resumed elsewhere (``ray_resume.py``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from servelm.connectors.ray_resume import ReplicaFailed

logger = logging.getLogger(__name__)

# How long a channel may take to open; longer, and its replica counts as gone.
OPEN_TIMEOUT_S = 60.0


class Channels:
    """Mailboxes of the running requests, fed by one reader per replica channel.

    ``open_channel(target)`` starts the Serve stream of
    ``EngineReplica.channel``; ``target`` names this front end's channel
    and the replica it must reach.
    """

    def __init__(self, open_channel: Callable[[dict[str, Any]], AsyncIterator[Any]]):
        self.id = uuid.uuid4().hex
        self._open = open_channel
        self._readers: dict[str, asyncio.Task] = {}  # replica id -> the task reading its channel
        self._mailboxes: dict[str, asyncio.Queue] = {}  # request id -> its outputs, errors, failures
        self._where: dict[str, str] = {}  # request id -> replica id

    def mailbox(self, request_id: str) -> asyncio.Queue:
        box: asyncio.Queue = asyncio.Queue()
        self._mailboxes[request_id] = box
        return box

    def close(self, request_id: str) -> None:
        self._mailboxes.pop(request_id, None)
        self._where.pop(request_id, None)

    def placed(self, request_id: str, replica: str) -> None:
        """The request runs on ``replica``: make sure its channel is read."""
        if request_id not in self._mailboxes:
            return
        self._where[request_id] = replica
        if replica not in self._readers:
            self._readers[replica] = asyncio.create_task(self._read(replica), name=f"servelm-channel-{replica}")

    def cancel(self) -> None:
        """Stop every reader; callable from any thread, also once the loop has ended."""
        for task in list(self._readers.values()):
            loop = task.get_loop()
            if not task.done() and not loop.is_closed():
                loop.call_soon_threadsafe(task.cancel)

    async def _read(self, replica: str) -> None:
        reason: BaseException
        response = None
        try:
            response = self._open({"channel": self.id, "pin": replica})
            items = aiter(response)
            async with asyncio.timeout(OPEN_TIMEOUT_S):
                await anext(items)  # {"replica": id}: open
            async for item in items:
                for request_id, out in item:
                    box = self._mailboxes.get(request_id)
                    if box is not None:
                        box.put_nowait(out)
            reason = ReplicaFailed(f"the channel from replica {replica} ended")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = ReplicaFailed(f"the channel from replica {replica} failed: {exc!r}")
        finally:
            self._readers.pop(replica, None)
            if response is not None:
                response.cancel()  # a no-op once the stream has ended
        left = [request_id for request_id, where in self._where.items() if where == replica]
        # A channel also ends when no request of this front end has run on its replica for a while.
        logger.log(logging.WARNING if left else logging.DEBUG, "%s; %d request(s) on it move", reason, len(left))
        for request_id in left:
            self._mailboxes[request_id].put_nowait(reason)
