"""Serving metrics from per-request results: pure maths, no I/O.

Times inside a :class:`~servelm.benchmark.client.RequestResult` are seconds;
every summary figure of a latency is in milliseconds, as vLLM reports them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from servelm.benchmark.client import RequestResult

SLO_METRICS = ("ttft", "tpot", "e2el")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    return float(np.percentile(values, q))


@dataclass(frozen=True)
class Distribution:
    """Mean, spread and percentiles of one latency, in milliseconds; all None with no samples."""

    count: int = 0
    mean: float | None = None
    std: float | None = None
    median: float | None = None
    p90: float | None = None
    p99: float | None = None
    min: float | None = None
    max: float | None = None

    @classmethod
    def of_seconds(cls, values: Iterable[float]) -> Distribution:
        """The distribution of ``values`` (seconds), reported in milliseconds."""
        ms = np.asarray(list(values), dtype=np.float64) * 1000.0
        if not ms.size:
            return cls()
        median, p90, p99 = (float(v) for v in np.percentile(ms, [50, 90, 99]))
        return cls(
            count=int(ms.size),
            mean=float(ms.mean()),
            std=float(ms.std()),  # population std
            median=median,
            p90=p90,
            p99=p99,
            min=float(ms.min()),
            max=float(ms.max()),
        )


def tpot(result: RequestResult) -> float | None:
    """Time per output token after the first, in seconds: (e2e - ttft) / (output_tokens - 1).

    None for a failed request or one with fewer than two output tokens (no
    decode time to divide).
    """
    if result.error is not None or result.ttft is None or result.output_tokens < 2:
        return None
    return (result.e2e - result.ttft) / (result.output_tokens - 1)


def parse_slos(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds).

    Raises ValueError naming the bad item: an unknown metric (not ttft, tpot
    or e2el), a value that is not a positive number, or a metric given twice.
    """
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(
                f"bad SLO {item!r}: expected METRIC:MILLISECONDS with METRIC one of {', '.join(SLO_METRICS)}"
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"bad SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"bad SLO {item!r}: the limit must be a positive number of milliseconds")
        if name in slos:
            raise ValueError(f"SLO {name} given twice")
        slos[name] = ms
    return slos


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    """True when a completed request is within every SLO (milliseconds).

    A request with one output token has no TPOT and so meets a TPOT SLO.
    """
    if result.error is not None or result.ttft is None:
        return False
    if "ttft" in slos and result.ttft * 1000.0 > slos["ttft"]:
        return False
    if "e2el" in slos and result.e2e * 1000.0 > slos["e2el"]:
        return False
    per_token = tpot(result)
    return not ("tpot" in slos and per_token is not None and per_token * 1000.0 > slos["tpot"])


def level_label(concurrency: int | None, request_rate: float | None) -> str:
    """``c=8``, ``r=2`` or ``r=2,c=8``."""
    parts = []
    if request_rate is not None:
        parts.append(f"r={request_rate:g}")
    if concurrency is not None:
        parts.append(f"c={concurrency}")
    return ",".join(parts)


@dataclass
class LevelSummary:
    """Everything measured at one load level (a concurrency and/or a request rate)."""

    concurrency: int | None
    request_rate: float | None
    num_requests: int
    completed: int
    failed: int
    errors: dict[str, int]
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None
    slos_ms: dict[str, float]
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    client_cpu_s: float = 0.0
    client_cpu_percent: float = 0.0
    requests: list[dict[str, Any]] | None = field(default=None)

    @property
    def label(self) -> str:
        """How the level is named in tables and plots (see :func:`level_label`)."""
        return level_label(self.concurrency, self.request_rate)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; ``requests`` (per-request detail) only when it was kept."""
        data = asdict(self)
        if data["requests"] is None:
            del data["requests"]
        return data


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    *,
    concurrency: int | None = None,
    request_rate: float | None = None,
    slos: dict[str, float] | None = None,
    client_cpu_s: float = 0.0,
) -> LevelSummary:
    """Summarize one level's results; ``duration_s`` is the level's wall time."""
    slos = slos or {}
    done = [r for r in results if r.error is None]
    errors = Counter(r.error for r in results if r.error is not None)
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    per_second = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    goodput = per_second(sum(1 for r in done if meets_slos(r, slos))) if slos else None
    return LevelSummary(
        concurrency=concurrency,
        request_rate=request_rate,
        num_requests=len(results),
        completed=len(done),
        failed=len(results) - len(done),
        errors=dict(errors.most_common()),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=per_second(len(done)),
        output_throughput=per_second(output_tokens),
        total_token_throughput=per_second(input_tokens + output_tokens),
        goodput=goodput,
        slos_ms=dict(slos),
        ttft_ms=Distribution.of_seconds(r.ttft for r in done if r.ttft is not None),
        tpot_ms=Distribution.of_seconds(t for t in (tpot(r) for r in done) if t is not None),
        itl_ms=Distribution.of_seconds(gap for r in done for gap in r.itl),
        e2el_ms=Distribution.of_seconds(r.e2e for r in done),
        client_cpu_s=client_cpu_s,
        client_cpu_percent=100.0 * client_cpu_s / duration_s if duration_s > 0 else 0.0,
    )
