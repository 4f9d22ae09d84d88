"""One real Ray cluster for the Ray tests: two nodes (raylets) on this machine, two replicas.

Session-scoped, so every Ray test shares one cluster start and one load of
the replicas. Two nodes of one CPU each rather than ``ray.init(num_cpus=2)``:
the same two CPUs, and the two-node test needs no second cluster. Torn down
with ``serve.shutdown()``, ``ray.shutdown()`` and the cluster's own
shutdown, which stop only the processes this fixture started (never
``ray stop``).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from servelm.engine.config import EngineConfig

MODEL = "smollm2-135m-instruct"
# 32 KV blocks of 16 tokens per replica (float32): a replica holds about four
# of the prefix test's system prompts (6 blocks each) in its prefix cache, not eight.
KV_CACHE_BYTES = 24_000_000
STARTUP_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RayDeployment:
    """The shared cluster: its address, the front end's URL and connector, the replica plan."""

    address: str
    url: str
    connector: Any
    plan: Any


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    """Poll ``predicate`` until it returns a truthy value; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@pytest.fixture(scope="session")
def ray_deployment() -> Iterator[RayDeployment]:
    import ray
    import uvicorn
    from ray import serve
    from ray.cluster_utils import Cluster

    from servelm.api import create_app
    from servelm.connectors.ray import RayConnector
    from servelm.connectors.ray_cluster import prepare_local_env
    from servelm.connectors.ray_deploy import ReplicaPlan, deploy
    from servelm.settings import Settings

    prepare_local_env()  # the replicas import this servelm
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    server = None
    thread = None
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, namespace="servelm")
        plan = ReplicaPlan(
            app_name="servelm-test",
            model=MODEL,
            embedding_model=None,
            served_model_name=None,
            engine=EngineConfig(dtype="float32", device="cpu", kv_cache_memory=KV_CACHE_BYTES, max_num_seqs=32),
            replicas=2,
            replica_cpus=1.0,
        )
        handle = deploy(plan, say=lambda message: None, timeout_s=STARTUP_TIMEOUT_S)
        connector = RayConnector(plan, handle=handle)
        connector.load()
        port = free_port()
        app = create_app(connector, Settings(embedding_model=None, max_waiting=None, log_level="warning"))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, name="ray-test-front-end", daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{port}"

        def serving() -> bool:
            try:
                r = httpx.get(url + "/v1/replicas", timeout=5)
            except httpx.HTTPError:
                return False
            return r.status_code == 200 and r.json()["serving"] == 2

        wait_for(serving, STARTUP_TIMEOUT_S, "two replicas to report RUNNING")
        yield RayDeployment(cluster.address, url, connector, plan)
    finally:
        if server is not None:
            server.should_exit = True
        if thread is not None:
            thread.join(15)
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def run(coro):
    """Run a coroutine to the end on a fresh event loop (tests here are sync)."""
    return asyncio.run(coro)
