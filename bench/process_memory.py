"""Resident memory of a process and all its descendants, sampled: what a server holds idle and under load.

bench/compare.sh samples each server's process tree twice: idle, after it is
ready and before the first request, and under load, while the benchmark
runs::

    .venv/bin/python bench/process_memory.py PID --phase idle --seconds 5 --out mem.json
    .venv/bin/python bench/process_memory.py PID --phase load --out mem.json &   # until SIGTERM or PID exits

A sample finds PID's descendants through /proc (by parent PID, so the workers
a server forks count: vLLM's engine core, Ray's workers) and sums each one's
RSS and PSS from /proc/<pid>/smaps_rollup (VmRSS of /proc/<pid>/status where
that cannot be read; PSS is then missing). RSS counts a page that two
processes share in both (vLLM's API server and engine core each map torch);
PSS splits it between them, so the tree's PSS is what it really takes from
the machine. A phase's figures (largest and median sample, the most
processes seen) are merged into ``--out`` under the phase's name, so both
phases land in one file. Linux only; standard library only.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Sample:
    """One look at a process tree: summed RSS and PSS in bytes (PSS None if any process hid it)."""

    rss: int
    pss: int | None
    processes: int


def parse_stat(text: str) -> tuple[int, str, int]:
    """(pid, state, parent pid) from the text of /proc/<pid>/stat.

    The command name sits in parentheses and may hold spaces and parentheses
    itself, so the fields after it are found from the last ')'.
    """
    pid = int(text[: text.index("(")])
    state, ppid = text[text.rindex(")") + 2 :].split()[:2]
    return pid, state, int(ppid)


def parent_pids(proc: Path = PROC) -> dict[int, int]:
    """{pid: parent pid} of every process now alive (a zombie has exited: it is left out)."""
    parents = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            pid, state, ppid = parse_stat((entry / "stat").read_text())
        except (OSError, ValueError):  # gone between listing and reading
            continue
        if state not in ("Z", "X"):
            parents[pid] = ppid
    return parents


def descendants(root: int, parents: Mapping[int, int]) -> set[int]:
    """``root`` and every process below it, given {pid: parent pid}; empty if ``root`` is not there."""
    if root not in parents:
        return set()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in tree:
                tree.add(child)
                todo.append(child)
    return tree


def process_memory(pid: int, proc: Path = PROC) -> tuple[int, int | None] | None:
    """(RSS, PSS) of one process in bytes; PSS None where smaps_rollup is unreadable; None if it is gone."""
    try:
        fields = _kib_fields((proc / str(pid) / "smaps_rollup").read_text())
        if "Rss" in fields:
            return fields["Rss"], fields.get("Pss")
    except OSError:
        pass
    try:
        fields = _kib_fields((proc / str(pid) / "status").read_text())
    except OSError:
        return None
    return fields.get("VmRSS", 0), None  # kernel threads have no VmRSS


def _kib_fields(text: str) -> dict[str, int]:
    """``Name:   123 kB`` lines as {name: bytes}."""
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            out[name.strip()] = int(parts[0]) * 1024
    return out


def sample_tree(root: int, proc: Path = PROC) -> Sample | None:
    """The summed memory of ``root``'s tree now; None once ``root`` is gone."""
    rss, pss, count = 0, 0, 0
    pss_known = True
    for pid in descendants(root, parent_pids(proc)):
        memory = process_memory(pid, proc)
        if memory is None:
            continue
        rss += memory[0]
        if memory[1] is None:
            pss_known = False
        else:
            pss += memory[1]
        count += 1
    if count == 0:
        return None
    return Sample(rss, pss if pss_known else None, count)


def summarize(samples: Iterable[Sample], interval_s: float) -> dict[str, float | int | None]:
    """A phase's figures: sample count, largest and median RSS and PSS in bytes, most processes seen."""
    samples = list(samples)
    rss = [s.rss for s in samples]
    pss = [s.pss for s in samples]
    known_pss = [p for p in pss if p is not None] if all(p is not None for p in pss) else []
    return {
        "samples": len(samples),
        "interval_s": interval_s,
        "rss_max": max(rss) if rss else None,
        "rss_median": statistics.median(rss) if rss else None,
        "pss_max": max(known_pss) if known_pss else None,
        "pss_median": statistics.median(known_pss) if known_pss else None,
        "processes_max": max((s.processes for s in samples), default=0),
    }


def sample_until(
    root: int, stop: threading.Event, interval_s: float, seconds: float | None, proc: Path = PROC
) -> list[Sample]:
    """Samples every ``interval_s`` until ``stop`` is set, ``seconds`` have passed, or ``root`` is gone."""
    samples = []
    end = None if seconds is None else time.monotonic() + seconds
    while True:
        sample = sample_tree(root, proc)
        if sample is None:
            break
        samples.append(sample)
        if len(samples) == 1:
            print(
                f"process_memory: sampling PID {root}'s tree ({sample.processes} processes)",
                file=sys.stderr,
                flush=True,
            )
        wait = interval_s if end is None else min(interval_s, end - time.monotonic())
        if wait <= 0 or stop.wait(wait):
            break
    return samples


def merge_phase(path: Path, phase: str, figures: dict[str, float | int | None]) -> None:
    """Write ``figures`` under ``phase`` in the JSON object at ``path``, keeping its other phases."""
    doc = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    doc[phase] = figures
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pid", type=int, help="the root of the process tree")
    ap.add_argument("--phase", required=True, help="the name the figures are stored under (idle, load)")
    ap.add_argument("--out", type=Path, required=True, help="JSON file the phase is merged into")
    ap.add_argument("--seconds", type=float, help="stop after this long (default: at SIGTERM/SIGINT or when PID exits)")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between samples (default: %(default)s)")
    args = ap.parse_args(argv)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    samples = sample_until(args.pid, stop, args.interval, args.seconds)
    if not samples:
        print(f"process_memory: PID {args.pid} is not running", file=sys.stderr)
        return 1
    figures = summarize(samples, args.interval)
    merge_phase(args.out, args.phase, figures)
    print(
        f"process_memory: {args.phase}: {figures['samples']} samples, RSS max {_mib(figures['rss_max'])} MiB, "
        f"PSS max {_mib(figures['pss_max'])} MiB, {figures['processes_max']} processes",
        file=sys.stderr,
    )
    return 0


def _mib(value: float | int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


if __name__ == "__main__":
    sys.exit(main())
