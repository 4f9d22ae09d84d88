"""Showing a run's results: a table on stdout, a JSON file, a latency-against-throughput plot."""

from __future__ import annotations

import datetime
import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from servelm.benchmark.metrics import LevelSummary

PLOT_INSTALL_HINT = "--plot needs matplotlib: pip install 'servelm[bench]'"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_table(levels: Sequence[LevelSummary]) -> str:
    """One row per level, latencies in milliseconds, and the failures below it by message."""
    header = [
        "level",
        "ok",
        "fail",
        "time s",
        "req/s",
        "out tok/s",
        "tot tok/s",
        "TTFT mean",
        "TTFT p50",
        "TTFT p99",
        "TPOT mean",
        "TPOT p50",
        "TPOT p99",
        "ITL p50",
        "ITL p99",
        "E2E p50",
        "E2E p99",
    ]
    with_goodput = any(level.goodput is not None for level in levels)
    if with_goodput:
        header.append("goodput")
    rows = [header]
    for s in levels:
        row = [
            s.label,
            str(s.completed),
            str(s.failed),
            f"{s.duration_s:.2f}",
            f"{s.request_throughput:.2f}",
            f"{s.output_throughput:.1f}",
            f"{s.total_token_throughput:.1f}",
            _ms(s.ttft_ms.mean),
            _ms(s.ttft_ms.median),
            _ms(s.ttft_ms.p99),
            _ms(s.tpot_ms.mean),
            _ms(s.tpot_ms.median),
            _ms(s.tpot_ms.p99),
            _ms(s.itl_ms.median),
            _ms(s.itl_ms.p99),
            _ms(s.e2el_ms.median),
            _ms(s.e2el_ms.p99),
        ]
        if with_goodput:
            row.append("-" if s.goodput is None else f"{s.goodput:.2f}")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = (
        ["(latencies in ms; goodput in req/s meeting " + _slo_text(levels) + ")"]
        if with_goodput
        else ["(latencies in ms)"]
    )
    for s in levels:
        for message, count in s.errors.items():
            notes.append(f"{s.label}: {count} failed: {message}")
    return "\n".join(lines + notes)


def _slo_text(levels: Sequence[LevelSummary]) -> str:
    slos = next((s.slos_ms for s in levels if s.slos_ms), {})
    return ", ".join(f"{name} <= {ms:g} ms" for name, ms in slos.items())


def cpu_line(cpu_s: float, wall_s: float) -> str:
    """``client CPU: 3.2% of one core (...)``: the benchmark process's own CPU use while sending."""
    percent = 100.0 * cpu_s / wall_s if wall_s > 0 else 0.0
    return f"client CPU: {percent:.1f}% of one core ({cpu_s:.2f} s CPU over {wall_s:.2f} s of requests)"


def result_document(
    params: dict[str, Any], levels: Sequence[LevelSummary], cpu_s: float, wall_s: float
) -> dict[str, Any]:
    """The JSON written by ``--result-json``: the run's parameters, the client's CPU use and each level."""
    from servelm import __version__

    return {
        "benchmark": "servelm bench serve",
        "servelm_version": __version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "params": params,
        "client_cpu": {
            "cpu_s": cpu_s,
            "wall_s": wall_s,
            "percent_of_one_core": 100.0 * cpu_s / wall_s if wall_s > 0 else 0.0,
        },
        "levels": [level.to_dict() for level in levels],
    }


def write_json(path: str | Path, document: dict[str, Any]) -> None:
    """Write ``document`` as indented JSON (a missing latency is null)."""
    Path(path).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")


def plot_available() -> bool:
    """Whether matplotlib is installed (without importing it)."""
    return importlib.util.find_spec("matplotlib") is not None


def plot(path: str | Path, levels: Sequence[LevelSummary], title: str = "") -> None:
    """Latency (y) against output throughput (x), one point per level: TTFT, and TPOT/ITL.

    Raises RuntimeError with an install hint when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(PLOT_INSTALL_HINT) from exc

    x = [s.output_throughput for s in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    try:
        panels: list[tuple[Any, str, list[tuple[str, list[float | None], str]]]] = [
            (
                left,
                "TTFT (ms)",
                [
                    ("TTFT p50", [s.ttft_ms.median for s in levels], "o-"),
                    ("TTFT p99", [s.ttft_ms.p99 for s in levels], "o--"),
                ],
            ),
            (
                right,
                "per output token (ms)",
                [
                    ("TPOT p50", [s.tpot_ms.median for s in levels], "s-"),
                    ("ITL p50", [s.itl_ms.median for s in levels], "^-"),
                    ("ITL p99", [s.itl_ms.p99 for s in levels], "^--"),
                ],
            ),
        ]
        for axis, ylabel, series in panels:
            for name, ys, style in series:
                points = [(xi, yi) for xi, yi in zip(x, ys) if yi is not None]
                if points:
                    axis.plot([p[0] for p in points], [p[1] for p in points], style, label=name)
            first = series[0][1]
            for s, xi, yi in zip(levels, x, first):
                if yi is not None:
                    axis.annotate(s.label, (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8)
            axis.set_xlabel("output throughput (tokens/s)")
            axis.set_ylabel(ylabel)
            axis.grid(True, alpha=0.3)
            axis.legend(fontsize=8)
        fig.suptitle(title or "servelm bench serve: latency against throughput")
        fig.tight_layout()
        fig.savefig(str(path), dpi=100)
    finally:
        plt.close(fig)


def level_line(s: LevelSummary) -> str:
    """A one-line summary printed (stderr) as each level ends."""
    return (
        f"{s.label}: {s.completed}/{s.num_requests} ok in {s.duration_s:.2f}s, {s.output_throughput:.1f} out tok/s, "
        f"TTFT p50 {_ms(s.ttft_ms.median)} ms, TPOT p50 {_ms(s.tpot_ms.median)} ms"
    )
