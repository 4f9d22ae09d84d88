"""The local connector's queue depth needs no loaded model."""

from __future__ import annotations

from servelm.connectors.base import QueueDepth
from servelm.connectors.local import LocalConnector


async def test_queue_depth_is_zero_before_load():
    conn = LocalConnector("smollm2-135m-instruct", None)
    assert await conn.queue_depth() == QueueDepth(running=0, waiting=0)
