"""bench/w8a8_gemm.py on tiny shapes: every candidate is timed and the ratio printed, one row adds the GEMV."""

from __future__ import annotations

import re

import pytest
import torch

from benchmark.bench_scripts import bench_script

w8a8_gemm = bench_script("w8a8_gemm")


def skip_without_the_kernels() -> None:
    from servelm import kernels
    from servelm.models.packed import can_pack

    native = kernels.cpu_kernels()
    probe = torch.zeros(1, 1, dtype=torch.int8)
    if native is None or native.w8a8_pack(probe) is None or not can_pack(torch.bfloat16, probe.device):
        pytest.skip("the W8A8 kernel or oneDNN's bfloat16 packing does not run here")


def test_tiny_run_prints_each_shape_with_its_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    skip_without_the_kernels()
    assert w8a8_gemm.main(["--gemm", "8x64x48", "1x64x48", "--repeats", "1"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert set(rows) == {"8x64x48", "1x64x48"}
    assert rows["8x64x48"][3] == "-" and rows["1x64x48"][3] != "-"  # one row: the int8 GEMV's rate too
    # A ratio is printed for each shape; its size is the machine's (a call preempted on a busy machine can
    # round it to 0.00x), which tests do not assert.
    assert all(re.fullmatch(r"\d+\.\d\dx", row[-1]) for row in rows.values())


def test_copies_pass_over_that_many_weights_and_say_so(capsys: pytest.CaptureFixture[str]) -> None:
    skip_without_the_kernels()
    assert w8a8_gemm.main(["--gemm", "8x64x48", "--repeats", "1", "--copies", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "over 3 copies of each weight" in out[0]
    row = out[2].split()
    assert row[0] == "8x64x48" and re.fullmatch(r"\d+\.\d\dx", row[-1])
