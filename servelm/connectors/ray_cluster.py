"""Starting a local Ray cluster inside the server, or joining an existing one.

``--replicas N`` alone starts a one-machine cluster in this process
(``ray.init``), kept on 127.0.0.1; ``--ray-address HOST:PORT`` (or ``auto``)
joins a cluster started with ``ray start``. Problems surface as
:class:`RayClusterError`, which ``servelm serve`` turns into exit status 2:
an address nothing answers at fails within ``JOIN_TIMEOUT_S`` rather than
after Ray's own minutes of retries.

Authentication: Ray 2.60 turns token auth on by default. ``RAY_AUTH_MODE``,
``RAY_AUTH_TOKEN`` and ``RAY_AUTH_TOKEN_PATH`` are passed through untouched
(docs/DEPLOY.md says how to set them); a join refused for want of a token
says which variable to set.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# How long joining may take before the server gives up (exit status 2).
JOIN_TIMEOUT_S = 25.0
# The TCP check of HOST:PORT before handing the address to Ray, whose own
# retries take minutes on an address where nothing listens.
CONNECT_CHECK_S = 5.0
# Ray rewrites 127.0.0.1 to the machine's address unless this is "0" (it is
# named for Windows and macOS, but it is what picks the loopback address).
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class RayClusterError(RuntimeError):
    """The cluster cannot be started or joined; the message says why."""


@dataclass
class ClusterInfo:
    """The cluster this process is connected to, and whether it started it."""

    address: str  # the GCS address other processes can join
    started_here: bool
    num_cpus: float
    num_gpus: float
    temp_dir: str | None = None  # the logs and sockets of a cluster started here


def servelm_root() -> str:
    """The folder holding the ``servelm`` package this process runs."""
    import servelm

    return str(Path(servelm.__file__).resolve().parent.parent)


def prepare_local_env() -> None:
    """Environment for a cluster started here, set before Ray is imported.

    Keeps every Ray address on loopback, and puts this servelm first on the
    workers' path so the replicas run the same code as the front end (Ray
    workers inherit the environment of the cluster this process starts).
    """
    os.environ.setdefault(LOOPBACK_ENV, "0")
    root = servelm_root()
    path = os.environ.get("PYTHONPATH", "")
    if root not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = root + (os.pathsep + path if path else "")


def connect(address: str | None, num_cpus: float | None = None, num_gpus: float | None = None) -> ClusterInfo:
    """Start a local cluster (``address`` None) or join one; returns what it found.

    Raises :class:`RayClusterError` when the address cannot be reached, no
    cluster answers there in ``JOIN_TIMEOUT_S``, or a token is missing.
    """
    if address is None:
        prepare_local_env()
        # Without --ray-address the cluster is this server's own, even where
        # RAY_ADDRESS names another (pass --ray-address auto to use that).
        os.environ.pop("RAY_ADDRESS", None)
    elif address != "auto":
        _check_reachable(address)
        if address.rpartition(":")[0].strip("[]") in ("127.0.0.1", "localhost", "::1"):
            # A cluster on loopback registered its nodes there: this driver must not rewrite its own address.
            os.environ.setdefault(LOOPBACK_ENV, "0")
    import ray

    if ray.is_initialized():
        return _info(started_here=False)
    kwargs: dict = {"include_dashboard": False, "log_to_driver": False, "namespace": "servelm"}
    if address is None:
        # A temp dir of its own: in Ray's shared one, ray.init() without an
        # address joins the cluster a `ray start` on this machine left there.
        temp_dir = tempfile.mkdtemp(prefix="servelm-ray-")
        kwargs.update(num_cpus=num_cpus, num_gpus=num_gpus, _temp_dir=temp_dir)
        # In the calling thread, never a helper thread: Ray ties the processes
        # it starts (GCS, raylet) to the life of the thread that started them.
        try:
            ray.init(**kwargs)
        except Exception as exc:
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise RayClusterError(f"could not start a local Ray cluster: {_explain(exc)}") from None
        return _info(started_here=True, temp_dir=temp_dir)
    kwargs["address"] = address
    error: list[BaseException] = []

    def init() -> None:
        try:
            ray.init(**kwargs)
        except BaseException as exc:
            error.append(exc)

    # Joining starts no process, so a thread can bound Ray's long retries.
    thread = threading.Thread(target=init, name="servelm-ray-init", daemon=True)
    thread.start()
    thread.join(JOIN_TIMEOUT_S)
    if thread.is_alive():
        raise RayClusterError(f"could not join the Ray cluster at {address}: no answer within {JOIN_TIMEOUT_S:.0f} s")
    if error:
        raise RayClusterError(f"could not join the Ray cluster at {address}: {_explain(error[0])}")
    return _info(started_here=False)


def _info(started_here: bool, temp_dir: str | None = None) -> ClusterInfo:
    import ray

    resources = ray.cluster_resources()
    return ClusterInfo(
        address=ray.get_runtime_context().gcs_address,
        started_here=started_here,
        num_cpus=float(resources.get("CPU", 0.0)),
        num_gpus=float(resources.get("GPU", 0.0)),
        temp_dir=temp_dir,
    )


def _check_reachable(address: str) -> None:
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise RayClusterError(f"--ray-address must be HOST:PORT or auto, got {address!r}")
    try:
        with socket.create_connection((host.strip("[]"), int(port_text)), timeout=CONNECT_CHECK_S):
            pass
    except OSError as exc:
        raise RayClusterError(f"cannot reach the Ray cluster at {address}: {exc}") from None


def _explain(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if "token" in text.lower() or "authenticat" in text.lower():
        return (
            f"{text} (the cluster uses token authentication: set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH to its "
            "token, see docs/DEPLOY.md)"
        )
    return text


def node_resources(resource: str) -> list[float]:
    """How much of ``resource`` (CPU, GPU) each alive node has: a replica must fit on one node."""
    import ray

    return [float(n.get("Resources", {}).get(resource, 0.0)) for n in ray.nodes() if n.get("Alive")]


def disconnect(info: ClusterInfo | None = None) -> None:
    """Leave the cluster; a cluster started here stops with it (``ray.shutdown``, never ``ray stop``)
    and its temp dir goes."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    if info is not None and info.temp_dir:
        shutil.rmtree(info.temp_dir, ignore_errors=True)
