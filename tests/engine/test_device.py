"""``auto`` dtype: bfloat16 on CUDA, and on a CPU where its matmuls are clearly faster or where oneDNN would emulate
them (servelm then multiplies bfloat16 layers in float32)."""

from __future__ import annotations

import logging

import pytest
import torch

from servelm.engine import device as device_mod
from servelm.engine.device import resolve_dtype


@pytest.fixture
def timings(monkeypatch):
    """Set the measured matmul seconds per dtype; clears the cached decision around the test."""
    figures: dict[torch.dtype, float] = {}
    monkeypatch.setattr(device_mod, "_matmul_seconds", lambda dtype: figures[dtype])
    monkeypatch.setattr(device_mod, "onednn_emulates_bf16", lambda: False)  # a CPU with bfloat16 instructions
    device_mod.cpu_prefers_bf16.cache_clear()
    yield figures
    device_mod.cpu_prefers_bf16.cache_clear()


@pytest.mark.parametrize(
    ("fp32_s", "bf16_s", "expected"),
    [
        (3.0, 1.0, torch.bfloat16),  # bf16 instructions: 3x faster
        (3.0, 2.5, torch.float32),  # faster, but not by the margin
        (1.0, 2.0, torch.float32),  # emulated bf16: slower
    ],
)
def test_auto_on_cpu_follows_the_measured_matmul_speed(timings, fp32_s, bf16_s, expected):
    timings.update({torch.float32: fp32_s, torch.bfloat16: bf16_s})
    assert resolve_dtype("auto", torch.device("cpu")) == expected


def test_auto_measures_once_per_process_and_logs_the_figures_once(timings, monkeypatch, caplog):
    calls = []
    seconds = {torch.bfloat16: 0.0005, torch.float32: 0.002}
    monkeypatch.setattr(device_mod, "_matmul_seconds", lambda dtype: calls.append(dtype) or seconds[dtype])
    with caplog.at_level(logging.INFO, logger="servelm.engine.device"):
        for _ in range(3):
            resolve_dtype("auto", torch.device("cpu"))
    assert calls == [torch.bfloat16, torch.float32]
    assert caplog.messages == [
        "dtype auto: a [128, 1024] x [1024, 2048] matmul takes 0.50 ms in bfloat16 vs 2.00 ms in float32 on this "
        "CPU (bfloat16 must be 1.5x faster): using bfloat16"
    ]


def test_auto_is_bfloat16_without_a_timing_where_onednn_would_emulate_it(monkeypatch, caplog):
    monkeypatch.setattr(device_mod, "onednn_emulates_bf16", lambda: True)
    monkeypatch.setattr(device_mod, "_matmul_seconds", lambda dtype: pytest.fail("timed although emulated"))
    device_mod.cpu_prefers_bf16.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="servelm.engine.device"):
            assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    finally:
        device_mod.cpu_prefers_bf16.cache_clear()
    assert caplog.messages == [
        "dtype auto: oneDNN has no bfloat16 instructions on this CPU, so bfloat16 layers multiply in float32 "
        "over weights widened once, and decoding one sequence reads half the bytes: using bfloat16"
    ]


def test_a_pinned_dtype_runs_no_timing(monkeypatch):
    monkeypatch.setattr(device_mod, "_matmul_seconds", lambda dtype: pytest.fail("timed although pinned"))
    device_mod.cpu_prefers_bf16.cache_clear()
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32


def test_auto_is_bf16_on_cuda_and_explicit_dtypes_are_kept(timings):
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert resolve_dtype(torch.float16, torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("int8", torch.device("cpu"))


def test_auto_on_other_devices_is_float32_whatever_the_cpu(timings):
    timings.update({torch.float32: 3.0, torch.bfloat16: 1.0})
    assert resolve_dtype("auto", torch.device("mps")) == torch.float32


def test_the_real_measurement_returns_positive_seconds():
    assert device_mod._matmul_seconds(torch.float32) > 0
