"""One markdown table from the ``servelm bench serve --result-json`` files of several servers.

Rows are servers (named by file stem: ``servelm.json`` -> servelm), columns are
output throughput, ITL p50 and TTFT p50 at each concurrency, then servelm's
output throughput divided by the row's (above 1: servelm is faster)::

    python bench/compare_table.py RESULTS_DIR            # every *.json in it
    python bench/compare_table.py a.json b.json --reference servelm

Standard library only. A missing level, metric or file shows as "-"; a file
that is not a result is named on stderr and skipped. The JSON keys read are
all in the block below, to adjust in one place if the result format changes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# --- the result JSON's layout -------------------------------------------------
LEVELS_KEY = "levels"  # top level: a list of per-level objects
CONCURRENCY_KEY = "concurrency"  # per level: the number of requests in flight
THROUGHPUT_KEY = "output_throughput"  # per level: output tokens/s
ITL_KEY = "itl_ms"  # per level: {"mean", "median"/"p50", "p90", "p99", ...} in ms
TTFT_KEY = "ttft_ms"
P50_KEYS = ("p50", "median")  # the first present is the median
COMPLETED_KEY = "completed"
FAILED_KEY = "failed"
# -------------------------------------------------------------------------------

DEFAULT_REFERENCE = "servelm"


def load_result(path: Path) -> dict[int, dict[str, Any]] | None:
    """{concurrency: level object} of one result file; None if it is not one."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"skipping {path}: {exc}", file=sys.stderr)
        return None
    levels = doc.get(LEVELS_KEY) if isinstance(doc, dict) else None
    if not isinstance(levels, list):
        print(f"skipping {path}: no {LEVELS_KEY!r} list", file=sys.stderr)
        return None
    by_concurrency: dict[int, dict[str, Any]] = {}
    for level in levels:
        if isinstance(level, dict) and isinstance(level.get(CONCURRENCY_KEY), int):
            by_concurrency[level[CONCURRENCY_KEY]] = level
    return by_concurrency


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def throughput(level: dict[str, Any] | None) -> float | None:
    """Output tokens/s of a level; None when missing, or when no request completed."""
    if level is None:
        return None
    if level.get(COMPLETED_KEY) == 0:
        return None
    return _number(level.get(THROUGHPUT_KEY))


def p50(level: dict[str, Any] | None, key: str) -> float | None:
    """The median of the distribution ``key`` of a level, in ms."""
    dist = level.get(key) if level else None
    if not isinstance(dist, dict):
        return None
    for name in P50_KEYS:
        if name in dist:
            return _number(dist[name])
    return None


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _failures(level: dict[str, Any] | None) -> str:
    failed = level.get(FAILED_KEY) if level else None
    return f" ({failed} failed)" if isinstance(failed, int) and failed > 0 else ""


def make_table(results: dict[str, dict[int, dict[str, Any]]], reference: str = DEFAULT_REFERENCE) -> str:
    """The markdown table; ``results`` maps a server's name to {concurrency: level}, in row order."""
    concurrencies = sorted({c for levels in results.values() for c in levels})
    header = ["server"]
    for c in concurrencies:
        header += [f"c={c} tok/s", f"c={c} ITL p50 ms", f"c={c} TTFT p50 ms"]
    ref = results.get(reference)
    if ref is not None:
        header += [f"{reference}/server c={c}" for c in concurrencies]
    rows = [header, ["---"] + ["---:"] * (len(header) - 1)]
    for name, levels in results.items():
        row = [name]
        for c in concurrencies:
            level = levels.get(c)
            row += [_fmt(throughput(level)) + _failures(level), _fmt(p50(level, ITL_KEY)), _fmt(p50(level, TTFT_KEY))]
        if ref is not None:
            for c in concurrencies:
                mine, theirs = throughput(ref.get(c)), throughput(levels.get(c))
                row.append("-" if mine is None or not theirs else f"{mine / theirs:.2f}x")
        rows.append(row)
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    if ref is None:
        lines.append(f"\n(no {reference!r} results: no ratio columns)")
    return "\n".join(lines)


def collect(paths: list[Path]) -> dict[str, dict[int, dict[str, Any]]]:
    """{name: levels} of the given files and of every *.json in the given folders, in order."""
    files: list[Path] = []
    for path in paths:
        files += sorted(path.glob("*.json")) if path.is_dir() else [path]
    results: dict[str, dict[int, dict[str, Any]]] = {}
    for file in files:
        levels = load_result(file)
        if levels is not None:
            results[file.stem] = levels
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", type=Path, help="result JSON files, or folders of them")
    ap.add_argument("--reference", default=DEFAULT_REFERENCE, help="the row the ratios divide by (default: %(default)s)")
    args = ap.parse_args(argv)
    results = collect(args.paths)
    if not results:
        print("no result files", file=sys.stderr)
        return 1
    # The reference row first, the others in the order given.
    if args.reference in results:
        results = {args.reference: results[args.reference], **{k: v for k, v in results.items() if k != args.reference}}
    print(make_table(results, args.reference))
    return 0


if __name__ == "__main__":
    sys.exit(main())
