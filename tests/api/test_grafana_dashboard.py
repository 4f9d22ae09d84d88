"""docs/grafana-dashboard.json queries metrics the server exposes, and counts a Ray deployment once.

The dashboard's PromQL is not run here (no Prometheus); what is checked is
what a wrong name or a missing label matcher would break: every metric a
panel names is one /metrics serves, and every engine figure, which a Ray
deployment serves once per replica and once summed, selects only the sum
(``{replica=""}``), so totals are not doubled.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from servelm.engine.outputs import EngineStats

from .conftest import make_app, make_client
from .fake_connector import CHAT_MODEL, FakeConnector

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
METRIC = re.compile(r"servelm:[a-z_]+")


def _exprs(node: object) -> list[str]:
    if isinstance(node, dict):
        return [e for k, v in node.items() for e in ([v] if k == "expr" else _exprs(v))]
    if isinstance(node, list):
        return [e for v in node for e in _exprs(v)]
    return []


class TwoReplicas(FakeConnector):
    """Engine figures as the Ray connector reports them: each replica's, then their sum."""

    async def engine_stats(self) -> list[EngineStats]:
        def stats(running: int, replica: str | None) -> EngineStats:
            return EngineStats(
                CHAT_MODEL,
                num_running=running,
                num_waiting=1,
                kv_cache_usage=0.5,
                prefix_cache_queries=10,
                prefix_cache_hits=5,
                dtype="float32",
                device="cpu",
                kv_cache_tokens=1024,
                kv_cache_bytes=1 << 20,
                replica=replica,
            )

        return [stats(3, None), stats(1, "a"), stats(2, "b")]


async def _scrape() -> dict[str, set[str]]:
    """Sample name -> label names seen, after one request of each kind the dashboard charts."""
    app = make_app(TwoReplicas(), rate_limits={"default": {"requests_per_minute": 1}})
    async with make_client(app) as c:
        body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
        assert (await c.post("/v1/chat/completions", json=body)).status_code == 429
        text = (await c.get("/metrics")).text
    seen: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            seen.setdefault(s.name, set()).update(s.labels)
    return seen


def test_the_dashboard_is_json_with_panels():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["panels"] and _exprs(dashboard)


async def test_every_metric_the_dashboard_queries_is_served():
    seen = await _scrape()
    names = {m for e in _exprs(json.loads(DASHBOARD.read_text())) for m in METRIC.findall(e)}
    assert names, "no servelm: metric in the dashboard"
    assert not names - set(seen), f"metrics the server does not serve: {sorted(names - set(seen))}"


async def test_per_replica_figures_are_not_added_to_their_sum():
    seen = await _scrape()
    per_replica = {name for name, labels in seen.items() if "replica" in labels}
    assert "servelm:num_requests_running" in per_replica  # the fake reports replicas, as Ray does
    for expr in _exprs(json.loads(DASHBOARD.read_text())):
        for match in METRIC.finditer(expr):
            if match.group() in per_replica:
                assert expr[match.end() :].startswith('{replica=""'), f"{match.group()} in {expr!r}"
