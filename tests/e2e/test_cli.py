"""The ``servelm serve`` command line, run as a process: fast, no model loaded."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _servelm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "servelm", *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def test_serve_help():
    done = _servelm("serve", "--help")
    assert done.returncode == 0, done.stderr
    assert "--model" in done.stdout and "--kv-cache-memory" in done.stdout


@pytest.mark.parametrize("flag", ["--model", "--embedding-model"])
def test_serve_missing_model_exits_2(flag):
    done = _servelm("serve", flag, "/nonexistent", "--port", "0")
    assert done.returncode == 2, done.stderr
    assert "/nonexistent" in done.stderr and flag in done.stderr
    assert "Traceback" not in done.stderr
