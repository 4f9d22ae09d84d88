"""bench/compare_table.py: the markdown table of several servers' ``--result-json`` files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "compare_table.py"
_spec = importlib.util.spec_from_file_location("compare_table", _PATH)
compare_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_table)


def _dist(median: float) -> dict:
    return {"count": 10, "mean": median * 1.1, "median": median, "p90": median * 2, "p99": median * 3}


def _level(concurrency: int, tok_s: float, itl: float, ttft: float, failed: int = 0) -> dict:
    return {
        "concurrency": concurrency,
        "request_rate": None,
        "completed": 16 - failed,
        "failed": failed,
        "output_throughput": tok_s,
        "ttft_ms": _dist(ttft),
        "itl_ms": _dist(itl),
        "tpot_ms": _dist(itl),
        "e2el_ms": _dist(ttft + 63 * itl),
    }


def _write(folder: Path, name: str, levels: list[dict]) -> Path:
    path = folder / f"{name}.json"
    path.write_text(json.dumps({"benchmark": "servelm bench serve", "params": {}, "levels": levels}))
    return path


def _rows(table: str) -> dict[str, list[str]]:
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("|")]
    return {row[0]: row[1:] for row in rows}


def test_table_has_a_row_per_server_and_ratios_to_servelm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, "vllm-cpu", [_level(1, 50.0, 20.0, 30.0), _level(8, 200.0, 40.0, 90.0)])
    _write(tmp_path, "servelm", [_level(1, 100.0, 10.0, 15.0), _level(8, 300.0, 25.0, 60.0)])

    assert compare_table.main([str(tmp_path)]) == 0
    rows = _rows(capsys.readouterr().out)

    header = rows["server"]
    assert header[:3] == ["c=1 tok/s", "c=1 ITL p50 ms", "c=1 TTFT p50 ms"]
    assert header[-2:] == ["servelm/server c=1", "servelm/server c=8"]
    assert list(rows)[2] == "servelm"  # the reference row comes first, after the header and rule
    assert rows["servelm"] == ["100.0", "10.0", "15.0", "300.0", "25.0", "60.0", "1.00x", "1.00x"]
    assert rows["vllm-cpu"] == ["50.0", "20.0", "30.0", "200.0", "40.0", "90.0", "2.00x", "1.50x"]


def test_missing_levels_metrics_and_bad_files_show_as_dashes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    servelm = _write(tmp_path, "servelm", [_level(1, 100.0, 10.0, 15.0), _level(32, 400.0, 50.0, 80.0)])
    partial = _level(1, 80.0, 12.0, 14.0, failed=2)
    del partial["itl_ms"]
    partial["ttft_ms"] = {"p50": 14.0}  # the other spelling of the median
    dead = {**_level(32, 0.0, 0.0, 0.0), "completed": 0, "failed": 16}
    peer = _write(tmp_path, "llama-server", [partial, dead])
    junk = tmp_path / "notes.json"
    junk.write_text("[1, 2, 3]")

    assert compare_table.main([str(servelm), str(peer), str(junk)]) == 0
    out = capsys.readouterr()
    rows = _rows(out.out)
    assert rows["llama-server"] == ["80.0 (2 failed)", "-", "14.0", "- (16 failed)", "0.0", "0.0", "1.25x", "-"]
    assert "notes.json" in out.err


def test_without_the_reference_there_are_no_ratio_columns(tmp_path: Path) -> None:
    results = {"vllm-cpu": {1: _level(1, 50.0, 20.0, 30.0)}}
    table = compare_table.make_table(results)
    assert "servelm/server" not in table
    assert "no 'servelm' results" in table


def test_no_results_is_an_error(tmp_path: Path) -> None:
    assert compare_table.main([str(tmp_path)]) == 1
