"""What the serving benchmarks share: a ``servelm serve`` started and stopped here, one ``servelm bench serve`` level.

Imported by the scripts next to it (``python bench/x.py`` puts ``bench/`` on
the path). Servers run on 127.0.0.1 on a free port and are stopped by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

MODEL = "smollm2-135m-instruct"
DTYPE = "bfloat16"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(args: list[str], env_extra: dict[str, str] | None = None, timeout: float = 600.0):
    """A ``servelm serve`` on a free port; yields its URL; stops it (SIGTERM, then SIGKILL) by PID."""

    # dtype pinned: `auto` times bfloat16 against float32 at start-up, and on a
    # loaded machine two servers could pick differently.
    def command(port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "servelm",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--embedding-model",
            "none",
            "--log-level",
            "warning",
            "--dtype",
            DTYPE,
            *args,
        ]

    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVELM_")}
    env.pop("RAY_ADDRESS", None)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.update(env_extra or {})
    with started(command, env, timeout) as (url, _proc):
        yield url


@contextlib.contextmanager
def started(command: Callable[[int], list[str]], env: dict[str, str] | None = None, timeout: float = 600.0):
    """``command(port)`` run on a free port until its ``/health`` is 200; yields (URL, process); stops it
    (SIGTERM, then SIGKILL) by PID."""
    port = free_port()
    with tempfile.NamedTemporaryFile(prefix="servelm-bench-", suffix=".log") as log:
        proc = subprocess.Popen(command(port), stdout=log, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited {proc.returncode}: {Path(log.name).read_text()[-2000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("server not ready in time")
                time.sleep(1)
            yield url, proc
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def bench_serve(
    url: str, concurrency: int, num_prompts: int, output_len: int, endpoint: str, extra_args: tuple[str, ...] = ()
) -> dict:
    """One ``servelm bench serve`` level (``extra_args`` added to its flags); returns its summary."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [
            sys.executable,
            "-m",
            "servelm",
            "bench",
            "serve",
            "--base-url",
            url,
            "--endpoint",
            endpoint,
            "--concurrency",
            str(concurrency),
            "--num-prompts",
            str(num_prompts),
            "--input-len",
            "128",
            "--output-len",
            str(output_len),
            "--warmup",
            str(min(concurrency, 4)),
            "--result-json",
            out.name,
            "--no-progress",
            *extra_args,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:  # say why: the client's own report is in its output
            raise RuntimeError(f"servelm bench serve exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
        return json.loads(Path(out.name).read_text())["levels"][0]


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(b: float | None, a: float | None) -> str:
    return f"{b / a:.2f}" if a and b is not None else "n/a"
