"""Readiness and graceful drain of one app.

On shutdown the server calls :meth:`Lifecycle.drain`: new work is refused
(503 ``server_shutting_down`` with Retry-After, and ``/ready`` turns 503),
the generation runs in flight get up to the shutdown timeout to finish, and
whatever is left is interrupted: each such client gets an error (a stream:
an error event, then ``[DONE]``) and its engine request is aborted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from servelm.api.errors import ServerShuttingDown

logger = logging.getLogger("servelm.api")

# How long interrupted runs get to send their error and close.
_INTERRUPT_GRACE_S = 5.0
_POLL_S = 0.05


class Interruptible(Protocol):
    def interrupt(self, exc: BaseException) -> None:
        """Make the run raise ``exc`` at its next wait for output."""
        ...


class Lifecycle:
    """Whether the app still admits work, and the generation runs in flight."""

    def __init__(self) -> None:
        self.draining = False
        self._runs: set[Interruptible] = set()

    def track(self, run: Interruptible) -> None:
        self._runs.add(run)

    def untrack(self, run: Interruptible) -> None:
        self._runs.discard(run)

    async def drain(self, timeout: float) -> int:
        """Stop admitting, let runs in flight finish for ``timeout`` seconds, interrupt the rest.

        Returns how many runs were interrupted. Idempotent: a second call
        only waits again.
        """
        self.draining = True
        if self._runs:
            logger.info("draining: %d request(s) in flight, waiting up to %g s", len(self._runs), timeout)
        await self._wait_idle(timeout)
        left = list(self._runs)
        for run in left:
            run.interrupt(ServerShuttingDown())
        if left:
            logger.warning("shutdown timeout: interrupted %d request(s) still in flight", len(left))
            await self._wait_idle(_INTERRUPT_GRACE_S)
        return len(left)

    async def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._runs and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
