"""bench/process_memory.py: the memory of a process tree, on a real tree of processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmark.bench_scripts import BENCH, bench_script

process_memory = bench_script("process_memory")

HELD = 64 * 2**20  # what the grandchild holds, written so every page is resident

# A child that starts a grandchild holding HELD bytes, prints "ready" once it holds
# them, and waits for stdin to close; the grandchild does the same.
GRANDCHILD = f"import sys; held = b'x' * {HELD}; print('ready', flush=True); sys.stdin.read()"
CHILD = (
    "import subprocess, sys; "
    f"g = subprocess.Popen([sys.executable, '-c', {GRANDCHILD!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True); "
    "print(g.stdout.readline().strip(), g.pid, flush=True); sys.stdin.read(); g.stdin.close(); g.wait()"
)


@pytest.fixture
def tree() -> Iterator[tuple[subprocess.Popen, int]]:
    """(child, grandchild PID), the grandchild holding HELD bytes."""
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    word, grandchild = child.stdout.readline().split()
    assert word == "ready"
    yield child, int(grandchild)
    if child.poll() is None:
        child.stdin.close()
        child.wait(timeout=60)


def test_parse_stat_finds_the_parent_after_a_command_name_with_spaces_and_parentheses() -> None:
    assert process_memory.parse_stat("4242 (my (odd) name) S 17 4242 4242 0 -1 4194560") == (4242, "S", 17)
    assert process_memory.parse_stat(Path(f"/proc/{os.getpid()}/stat").read_text()) == (os.getpid(), "R", os.getppid())


@given(st.lists(st.integers(0, 30), min_size=1, max_size=30), st.integers(0, 30))
def test_descendants_are_the_processes_whose_chain_of_parents_reaches_the_root(
    parent_picks: list[int], root: int
) -> None:
    # Process i + 1's parent is one of the processes before it (a forest under 0).
    parents = {i + 1: pick % (i + 1) for i, pick in enumerate(parent_picks)}
    parents[0] = -1

    def reaches(pid: int) -> bool:
        while pid != -1:
            if pid == root:
                return True
            pid = parents[pid]
        return False

    expected = {pid for pid in parents if reaches(pid)} if root in parents else set()
    assert process_memory.descendants(root, parents) == expected


def test_a_sample_sums_the_whole_tree(tree: tuple[subprocess.Popen, int]) -> None:
    child, grandchild = tree
    sample = process_memory.sample_tree(child.pid)
    assert sample.processes == 2
    assert sample.rss >= HELD
    assert sample.pss is not None and HELD <= sample.pss <= sample.rss
    alone = process_memory.sample_tree(grandchild)
    assert alone.processes == 1
    assert alone.rss < sample.rss  # the child's own memory comes on top


def test_a_process_that_is_not_running_has_no_sample() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    # Exited but not yet waited for: a zombie, which holds no memory and counts as gone.
    os.waitid(os.P_PID, gone.pid, os.WEXITED | os.WNOWAIT)
    assert Path(f"/proc/{gone.pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    assert process_memory.sample_tree(gone.pid) is None
    gone.wait()
    assert process_memory.sample_tree(gone.pid) is None


def _sampler(pid: int, out: Path, *args: str) -> subprocess.Popen:
    """The sampler's command line on ``pid``, started, once it has taken its first sample."""
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / "process_memory.py"), str(pid), "--out", str(out), *args],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert "sampling PID" in proc.stderr.readline()
    return proc


def test_load_phase_runs_until_sigterm_and_idle_phase_merges_beside_it(
    tree: tuple[subprocess.Popen, int], tmp_path: Path
) -> None:
    child, _ = tree
    out = tmp_path / "memory-servelm.json"
    assert (
        subprocess.run(
            [
                sys.executable,
                str(BENCH / "process_memory.py"),
                str(child.pid),
                "--out",
                str(out),
                "--phase",
                "idle",
                "--seconds",
                "0.3",
                "--interval",
                "0.1",
            ],
            timeout=60,
        ).returncode
        == 0
    )
    sampler = _sampler(child.pid, out, "--phase", "load", "--interval", "0.1")
    sampler.send_signal(signal.SIGTERM)
    assert sampler.wait(timeout=60) == 0

    doc = json.loads(out.read_text())
    assert set(doc) == {"idle", "load"}
    for phase in doc.values():
        assert phase["samples"] >= 1
        assert phase["processes_max"] == 2
        assert phase["rss_max"] >= phase["rss_median"] >= HELD
        assert phase["pss_max"] >= HELD


def test_load_phase_ends_when_the_root_exits(tree: tuple[subprocess.Popen, int], tmp_path: Path) -> None:
    child, _ = tree
    out = tmp_path / "memory.json"
    sampler = _sampler(child.pid, out, "--phase", "load", "--interval", "0.1")
    child.stdin.close()  # the child closes the grandchild's stdin and both exit
    child.wait(timeout=60)
    assert sampler.wait(timeout=60) == 0
    assert json.loads(out.read_text())["load"]["rss_max"] >= HELD


def test_a_pid_that_is_not_running_is_an_error(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    out = tmp_path / "memory.json"
    assert process_memory.main([str(gone.pid), "--out", str(out), "--phase", "idle", "--seconds", "1"]) == 1
    assert not out.exists()
