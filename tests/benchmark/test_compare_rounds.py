"""bench/compare_rounds.py: per-round ratios of bench/compare.sh's rounds against the first server, and medians."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmark.bench_scripts import bench_script

compare_rounds = bench_script("compare_rounds")


def _level(concurrency: int, tok_s: float, ttft: float) -> dict:
    dist = {"median": ttft, "mean": ttft, "p99": ttft}
    return {"concurrency": concurrency, "completed": 32, "failed": 0, "output_throughput": tok_s, "ttft_ms": dist}


def _round(folder: Path, order: list[str], results: dict[str, list[dict]]) -> Path:
    folder.mkdir()
    (folder / "order").write_text("".join(f"{name}\n" for name in order))
    for name, levels in results.items():
        (folder / f"{name}.json").write_text(json.dumps({"levels": levels}))
    return folder


def _rows(out: str) -> dict[tuple[str, str], list[str]]:
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("|")]
    return {(row[0], row[1]): row[2:] for row in rows[2:]}


def test_each_round_gives_a_ratio_and_the_median_is_taken_over_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # round r starts at the list's r-th server, as compare.sh runs them; round-10 sorts after round-2
    _round(
        tmp_path / "round-1",
        ["servelm-bf16", "vllm-cpu"],
        {"servelm-bf16": [_level(32, 300.0, 1000.0)], "vllm-cpu": [_level(32, 200.0, 2000.0)]},
    )
    _round(
        tmp_path / "round-2",
        ["vllm-cpu", "servelm-bf16"],
        {"servelm-bf16": [_level(32, 240.0, 1200.0)], "vllm-cpu": [_level(32, 300.0, 600.0)]},
    )
    _round(
        tmp_path / "round-10",
        ["servelm-bf16", "vllm-cpu"],
        {"servelm-bf16": [_level(32, 330.0, 900.0)], "vllm-cpu": [_level(32, 220.0, 1800.0)]},
    )
    folders = [str(tmp_path / name) for name in ("round-10", "round-1", "round-2")]

    assert compare_rounds.main(folders) == 0
    out = capsys.readouterr().out

    assert out.index("round-1:") < out.index("round-2:") < out.index("round-10:")
    assert "- round-2: vllm-cpu, servelm-bf16" in out
    # the reference is round 1's first server: its tok/s over vLLM's, vLLM's TTFT over its own
    assert _rows(out)[("vllm-cpu", "32")] == [
        "1.50x / 0.80x / 1.50x",
        "**1.50x**",
        "2.00x / 0.50x / 2.00x",
        "**2.00x**",
    ]


def test_a_named_reference_and_a_round_a_server_is_missing_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _round(
        tmp_path / "round-1",
        ["a", "b"],
        {"a": [_level(32, 100.0, 10.0)], "b": [_level(32, 200.0, 20.0)]},
    )
    _round(tmp_path / "round-2", ["b"], {"b": [_level(32, 100.0, 10.0)]})  # a did not start in round 2

    assert compare_rounds.main([str(tmp_path / "round-1"), str(tmp_path / "round-2"), "--reference", "b"]) == 0
    assert _rows(capsys.readouterr().out)[("a", "32")] == ["2.00x / -", "**2.00x**", "0.50x / -", "**0.50x**"]


def test_without_the_references_results_it_says_so_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _round(tmp_path / "round-1", ["a"], {"b": [_level(32, 100.0, 10.0)]})
    assert compare_rounds.main([str(tmp_path / "round-1")]) == 1
    assert "no results of the reference 'a'" in capsys.readouterr().err


def test_rounds_in_which_no_server_ran_say_so_and_fail(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "round-1").mkdir()  # compare.sh skipped every server: no order file, no results
    assert compare_rounds.main([str(tmp_path / "round-1")]) == 1
    assert "no server ran in" in capsys.readouterr().err
