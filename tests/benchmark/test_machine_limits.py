"""bench/machine_limits.py on tiny sizes: every limit is measured and named, a missing path is reported, not fatal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmark.bench_scripts import bench_script

machine_limits = bench_script("machine_limits")


def test_small_run_writes_every_limit_with_how_it_was_reached(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "limits.json"
    assert machine_limits.main(["--gemm", "64x32x48", "--read-mib", "4", "--repeats", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["threads"] >= 1
    for rate, how in (("bf16_gemm_flops", "bf16_gemm_how"), ("read_bytes_per_s", "read_how")):
        assert doc[rate] > 0
        assert doc[how] in {m["how"] for m in doc["measurements"]}
    # The int8 peak is the best candidate that ran; each one that could not run says why.
    ran = [m for m in doc["measurements"] if m["limit"] == "int8_gemm" and m["rate"] is not None]
    assert doc["int8_gemm_ops"] == max((m["rate"] for m in ran), default=None)
    assert all(m["error"] for m in doc["measurements"] if m["rate"] is None)
    assert "bf16 GEMM peak" in capsys.readouterr().out


def test_best_candidate_is_the_limit() -> None:
    M = machine_limits.Measurement
    doc = machine_limits.summary(
        [
            M("bf16_gemm", "a", 1e9),
            M("bf16_gemm", "b", 3e9),
            M("int8_gemm", "c", None, "RuntimeError: no"),
            M("read", "d", 2e9),
        ]
    )
    assert (doc["bf16_gemm_flops"], doc["bf16_gemm_how"]) == (3e9, "b")
    assert (doc["int8_gemm_ops"], doc["int8_gemm_how"]) == (None, None)
    assert (doc["read_bytes_per_s"], doc["read_how"]) == (2e9, "d")


def test_gemm_shape_parsing() -> None:
    assert machine_limits.parse_gemm("2048x896x4864") == (2048, 896, 4864)
    with pytest.raises(Exception, match="MxKxN"):
        machine_limits.parse_gemm("2048x896")
