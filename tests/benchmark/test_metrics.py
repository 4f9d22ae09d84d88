"""The benchmark's pure maths: percentiles, TPOT, ITL, goodput, level summaries."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from servelm.benchmark.client import RequestResult
from servelm.benchmark.metrics import Distribution, meets_slos, parse_slos, percentile, summarize, tpot


def ok(ttft: float, e2e: float, out: int, itl: list[float] | None = None, prompt: int = 10) -> RequestResult:
    return RequestResult(output_len=out, prompt_tokens=prompt, output_tokens=out, ttft=ttft, e2e=e2e, itl=itl or [])


def failed(message: str) -> RequestResult:
    return RequestResult(output_len=8, error=message)


def test_percentile_known_values():
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 100) == 5.0
    assert percentile(values, 25) == 2.0
    assert percentile([10.0, 20.0], 90) == pytest.approx(19.0)  # interpolated between ranks
    assert percentile([7.0], 99) == 7.0
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0  # order of the input does not matter


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-6)


def test_distribution_in_milliseconds():
    d = Distribution.of_seconds([0.1, 0.2, 0.3, 0.4])
    assert d.count == 4
    assert d.mean == pytest.approx(250.0)
    assert d.median == pytest.approx(250.0)
    assert d.std == pytest.approx(float(np.std([100, 200, 300, 400])))
    assert d.p99 == pytest.approx(float(np.percentile([100, 200, 300, 400], 99)))
    assert (d.min, d.max) == (pytest.approx(100.0), pytest.approx(400.0))
    empty = Distribution.of_seconds([])
    assert empty.count == 0 and empty.mean is None and empty.p99 is None


def test_tpot_is_decode_time_per_token_after_the_first():
    assert tpot(ok(ttft=0.1, e2e=1.0, out=10)) == pytest.approx(0.1)
    assert tpot(ok(ttft=0.1, e2e=0.1, out=1)) is None  # one token: no decode time
    assert tpot(failed("HTTP 500: x")) is None


def test_goodput_counts_requests_within_every_slo():
    fast = ok(ttft=0.1, e2e=1.0, out=10)  # TPOT 100 ms
    slow_start = ok(ttft=0.6, e2e=1.5, out=10)  # TTFT 600 ms, TPOT 100 ms
    slow_decode = ok(ttft=0.1, e2e=3.0, out=10)  # TPOT ~322 ms
    one_token = ok(ttft=0.2, e2e=0.2, out=1)  # no TPOT: meets a TPOT SLO
    slos = {"ttft": 500.0, "tpot": 150.0}
    assert meets_slos(fast, slos)
    assert not meets_slos(slow_start, slos)
    assert not meets_slos(slow_decode, slos)
    assert meets_slos(one_token, slos)
    assert not meets_slos(failed("boom"), slos)
    assert not meets_slos(fast, {"e2el": 999.0})
    assert meets_slos(fast, {"e2el": 1000.0})  # the limit itself is within

    summary = summarize([fast, slow_start, slow_decode, one_token, failed("boom")], duration_s=2.0, slos=slos)
    assert summary.goodput == pytest.approx(2 / 2.0)
    assert summarize([fast], duration_s=1.0).goodput is None  # no SLOs: no goodput


def test_parse_slos():
    assert parse_slos(["ttft:500", "TPOT:50", "e2el:10000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 10000.0}
    assert parse_slos([]) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:fast"], ["ttft:0"], ["ttft:-1"], ["ttft:1", "ttft:2"], ["ttft:inf"]):
        with pytest.raises(ValueError):
            parse_slos(bad)


def test_summarize_throughput_itl_and_errors():
    results = [
        ok(ttft=0.1, e2e=0.5, out=5, itl=[0.1, 0.1, 0.1, 0.1], prompt=20),
        ok(ttft=0.2, e2e=1.0, out=9, itl=[0.1] * 8, prompt=30),
        failed("HTTP 429: slow down"),
        failed("HTTP 429: slow down"),
        failed("stream ended without [DONE]"),
    ]
    s = summarize(results, duration_s=2.0, concurrency=4, client_cpu_s=0.5)
    assert (s.num_requests, s.completed, s.failed) == (5, 2, 3)
    assert s.errors == {"HTTP 429: slow down": 2, "stream ended without [DONE]": 1}
    assert s.total_input_tokens == 50 and s.total_output_tokens == 14
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(7.0)
    assert s.total_token_throughput == pytest.approx(32.0)
    assert s.ttft_ms.mean == pytest.approx(150.0)
    assert s.itl_ms.count == 12 and s.itl_ms.median == pytest.approx(100.0)
    assert s.tpot_ms.count == 2 and s.tpot_ms.mean == pytest.approx(100.0)
    assert s.e2el_ms.max == pytest.approx(1000.0)
    assert s.client_cpu_percent == pytest.approx(25.0)
    assert s.label == "c=4"
    data = s.to_dict()
    assert data["ttft_ms"]["median"] == pytest.approx(150.0) and "requests" not in data


def test_summarize_all_failed_has_no_latencies():
    s = summarize([failed("connection error: ConnectError: refused")] * 3, duration_s=0.01)
    assert s.completed == 0 and s.failed == 3
    assert s.ttft_ms.mean is None and s.output_throughput == 0.0
    assert math.isfinite(s.request_throughput)


def test_itl_samples_reproduce_e2e_minus_ttft():
    # ITL gaps of one request add up to the time from the first to the last content chunk.
    rng = random.Random(3)
    gaps = [rng.uniform(0.01, 0.05) for _ in range(15)]
    r = ok(ttft=0.3, e2e=0.3 + sum(gaps), out=16, itl=gaps)
    assert tpot(r) == pytest.approx(sum(gaps) / 15)
    assert summarize([r], 1.0).itl_ms.mean == pytest.approx(1000 * sum(gaps) / 15)
