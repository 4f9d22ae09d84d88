"""End-to-end fixtures: a real ``servelm serve`` process on the bundled models.

The server runs as a subprocess on 127.0.0.1 and a free port. Only the process
started here is ever stopped, by its own handle (terminate, then kill).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

CHAT_MODEL = "smollm2-135m-instruct"
EMBEDDING_MODEL = "all-minilm-l6-v2"
KV_CACHE_BYTES = 256 << 20
STARTUP_TIMEOUT_S = 300.0  # a safety net: startup ends when /health says 200
STOP_TIMEOUT_S = 15.0
# A server with --replicas starts a Ray cluster and loads the models once per replica.
RAY_STARTUP_TIMEOUT_S = 300.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: Path, limit: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-limit:]


def _stop(proc: subprocess.Popen) -> None:
    """Stop the one server process started here, and only it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S)


@dataclass
class ServerProcess:
    """A started ``servelm serve``: its base URL, its process and its stderr log."""

    url: str
    proc: subprocess.Popen
    stderr_path: Path

    def stderr(self) -> str:
        return _tail(self.stderr_path)


@contextlib.contextmanager
def server_process(
    extra_args: Sequence[str] = (),
    python_args: Sequence[str] = ("-m", "servelm"),
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
) -> Iterator[ServerProcess]:
    """Start ``servelm serve`` with ``extra_args``, wait until ``/health`` is 200, yield it.

    ``python_args`` replace ``-m servelm`` (a test harness that patches the
    engine first, then calls the same CLI).
    """
    port = free_port()
    cmd = [
        sys.executable,
        *python_args,
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--kv-cache-memory",
        str(KV_CACHE_BYTES),
        # Pinned, so that a KV cache of KV_CACHE_BYTES holds the same tokens on
        # every machine (``auto`` is bfloat16 on CPUs with fast bf16 matmuls).
        "--dtype",
        "float32",
        "--log-level",
        "warning",
        *extra_args,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVELM_")}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    # With --replicas: the server's own Ray cluster, on loopback, without token auth.
    env.pop("RAY_ADDRESS", None)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="servelm-e2e-") as tmp:
        stderr_path = Path(tmp) / "stderr.log"
        # Files, not pipes: a pipe nobody reads would fill up and block the server.
        with open(stderr_path, "wb") as stderr, open(Path(tmp) / "stdout.log", "wb") as stdout:
            proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env=env)
            try:
                deadline = time.monotonic() + startup_timeout_s
                while True:
                    if proc.poll() is not None:
                        pytest.fail(
                            f"servelm serve exited with status {proc.returncode} before it was ready:\n"
                            f"{_tail(stderr_path)}"
                        )
                    try:
                        if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        pytest.fail(
                            f"servelm serve was not ready within {startup_timeout_s:.0f}s:\n{_tail(stderr_path)}"
                        )
                    time.sleep(0.5)
                yield ServerProcess(url, proc, stderr_path)
            finally:
                _stop(proc)


@contextlib.contextmanager
def running_server(extra_args: Sequence[str] = (), startup_timeout_s: float = STARTUP_TIMEOUT_S) -> Iterator[str]:
    """Start ``servelm serve`` with ``extra_args``, wait until ``/health`` is 200, yield its base URL."""
    with server_process(extra_args, startup_timeout_s=startup_timeout_s) as server:
        yield server.url


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """Base URL of a ``servelm serve`` on both bundled models (default settings otherwise)."""
    with running_server(["--model", CHAT_MODEL, "--embedding-model", EMBEDDING_MODEL]) as url:
        yield url
