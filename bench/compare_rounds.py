"""Per-round ratios and their medians, from bench/compare.sh's rounds (``ROUNDS=N``).

With ``ROUNDS=N`` compare.sh runs its list of servers N times, round r
starting at the list's r-th server, into ``OUT/round-R/`` (each with the
servers' result files, an ``order`` file naming them in the order they ran,
and its own table.md). This prints, for every other server and every
concurrency, the reference's output tok/s over the server's and the server's
TTFT p50 over the reference's, round by round and their median: above 1, the
reference is ahead. The reference is the server that ran first in the first
round (the list's first), unless ``--reference`` names another. This VM's
speed swings between minutes, so one round's ratio is one sample::

    python bench/compare_rounds.py OUT/round-*
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from compare_table import TTFT_KEY, collect, p50, throughput

ORDER_FILE = "order"  # compare.sh: the servers' labels, one a line, in the order they ran

Results = dict[str, dict[int, dict[str, Any]]]


def round_number(folder: Path) -> int:
    """R of a ``round-R`` folder (0 for another name), so that round-10 sorts after round-9."""
    match = re.fullmatch(r"round-(\d+)", folder.name)
    return int(match.group(1)) if match else 0


def run_order(folder: Path) -> list[str]:
    """The labels of the servers in the order they ran in this round; [] without an order file."""
    try:
        return [line.strip() for line in (folder / ORDER_FILE).read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError:
        return []


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _cells(values: list[float | None]) -> tuple[str, str]:
    """Each round's ratio joined by " / ", and their median ("-" for a round or median without one)."""
    shown = " / ".join("-" if v is None else f"{v:.2f}x" for v in values)
    present = [v for v in values if v is not None]
    return shown, (f"**{statistics.median(present):.2f}x**" if present else "-")


def rounds_table(rounds: list[Results], reference: str) -> str:
    """The markdown table of ratios against ``reference``, one row per other server and concurrency."""
    servers = list(dict.fromkeys(name for results in rounds for name in results if name != reference))
    concurrencies = sorted({c for results in rounds for levels in results.values() for c in levels})
    rows = [
        [
            "server",
            "c",
            f"{reference} tok/s over server's, per round",
            "median",
            f"TTFT p50 over {reference}'s",
            "median",
        ],
        ["---", "---:", "---:", "---:", "---:", "---:"],
    ]
    for server in servers:
        for c in concurrencies:
            tok, ttft = [], []
            for results in rounds:
                ref, other = results.get(reference, {}).get(c), results.get(server, {}).get(c)
                tok.append(_ratio(throughput(ref), throughput(other)))
                ttft.append(_ratio(p50(other, TTFT_KEY), p50(ref, TTFT_KEY)))
            rows.append([server, str(c), *_cells(tok), *_cells(ttft)])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rounds", nargs="+", type=Path, help="compare.sh's round-R folders")
    ap.add_argument("--reference", help="the server the ratios are taken against (default: round 1's first)")
    args = ap.parse_args(argv)
    folders = sorted(args.rounds, key=round_number)
    rounds = [collect([folder]) for folder in folders]
    orders = [run_order(folder) for folder in folders]
    reference = args.reference or next((order[0] for order in orders if order), None)
    where = ", ".join(map(str, folders))
    if reference is None:
        print(f"no server ran in {where} (no {ORDER_FILE} file names one)", file=sys.stderr)
        return 1
    if not any(reference in results for results in rounds):
        print(f"no results of the reference {reference!r} in {where}", file=sys.stderr)
        return 1
    for folder, order in zip(folders, orders):
        print(f"- {folder.name}: {', '.join(order) if order else '(no order file)'}")
    print()
    print(rounds_table(rounds, reference))
    return 0


if __name__ == "__main__":
    sys.exit(main())
