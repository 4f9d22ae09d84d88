"""Every error docs/API.md lists is one the server sends, and every error the server sends is listed.

The table under "Errors" in docs/API.md is parsed; each row must be produced
by at least one request below, with the row's status and one of the
``type``/``code`` names it shows, and each request's error must match a row.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from servelm.api.errors import ServerShuttingDown
from servelm.connectors.base import ConnectorError

from .conftest import make_app, make_client
from .fake_connector import FakeConnector

API_MD = Path(__file__).resolve().parents[2] / "docs" / "API.md"
CHAT = {"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5}


def documented_rows() -> list[tuple[set[int], set[str], set[str | None]]]:
    """(statuses, types, codes) of each row of the error table; a code of ``null`` is None."""
    lines = API_MD.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| Status | When |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = line.split("|")
        statuses = {int(s) for s in re.findall(r"\d{3}", cells[1])}
        types_cell, _, codes_cell = cells[-2].partition(" / ")
        codes: set[str | None] = set(re.findall(r"`([^`]+)`", codes_cell))
        if codes_cell.strip() == "null":
            codes.add(None)
        rows.append((statuses, set(re.findall(r"`([^`]+)`", types_cell)), codes))
    return rows


Producer = Callable[[], Awaitable[httpx.Response]]


async def _call(
    fake: FakeConnector,
    method: str,
    path: str,
    body: object = None,
    raw: bytes | None = None,
    headers: dict | None = None,
    **settings: object,
) -> httpx.Response:
    async with make_client(make_app(fake, **settings)) as c:
        if raw is not None:
            return await c.request(method, path, content=raw, headers={"content-type": "application/json"})
        return await c.request(method, path, json=body, headers=headers)


async def invalid_field() -> httpx.Response:
    return await _call(FakeConnector(), "POST", "/v1/chat/completions", {**CHAT, "n": 0})


async def invalid_tool() -> httpx.Response:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "banana"}}}
    return await _call(FakeConnector(), "POST", "/v1/chat/completions", {**CHAT, "tools": [tool]})


async def invalid_json() -> httpx.Response:
    return await _call(FakeConnector(), "POST", "/v1/chat/completions", raw=b'{"model": ')


async def context_too_long() -> httpx.Response:
    return await _call(
        FakeConnector(max_model_len=8),
        "POST",
        "/v1/completions",
        {"model": "fake-chat", "prompt": "far too long a prompt", "max_tokens": 1},
    )


async def model_not_supported() -> httpx.Response:
    return await _call(FakeConnector(), "POST", "/v1/chat/completions", {**CHAT, "model": "fake-embed"})


async def invalid_structured_output() -> httpx.Response:
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}
    return await _call(FakeConnector(), "POST", "/v1/chat/completions", {**CHAT, "response_format": schema})


async def bad_key() -> httpx.Response:
    return await _call(
        FakeConnector(),
        "POST",
        "/v1/chat/completions",
        CHAT,
        headers={"authorization": "Bearer wrong"},
        api_keys=["right"],
    )


async def unknown_model() -> httpx.Response:
    return await _call(FakeConnector(), "POST", "/v1/chat/completions", {**CHAT, "model": "gpt-4"})


async def unknown_route() -> httpx.Response:
    return await _call(FakeConnector(), "GET", "/v1/nothing")


async def wrong_method() -> httpx.Response:
    return await _call(FakeConnector(), "GET", "/v1/chat/completions")


async def too_large() -> httpx.Response:
    return await _call(
        FakeConnector(), "POST", "/v1/chat/completions", {**CHAT, "user": "x" * 4096}, max_body_bytes=1024
    )


async def rate_limited() -> httpx.Response:
    fake = FakeConnector()
    async with make_client(make_app(fake, rate_limits={"default": {"requests_per_minute": 1}})) as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        return await c.post("/v1/chat/completions", json=CHAT)


async def timed_out() -> httpx.Response:
    # Held forever after one output: the timeout is what ends it, however slow the machine.
    return await _call(FakeConnector(hold_after=1), "POST", "/v1/chat/completions", CHAT, request_timeout=0.05)


async def queue_full() -> httpx.Response:
    return await _call(FakeConnector(waiting=3), "POST", "/v1/chat/completions", CHAT, max_waiting=3)


async def queue_timeout() -> httpx.Response:
    return await _call(FakeConnector(hold_before_first=True), "POST", "/v1/chat/completions", CHAT, queue_timeout=0.05)


async def engine_error() -> httpx.Response:
    return await _call(FakeConnector(error_after=1), "POST", "/v1/chat/completions", CHAT)


async def unexpected() -> httpx.Response:
    fake = FakeConnector()

    async def broken(*args: object, **kwargs: object) -> list[int]:
        raise RuntimeError("internal detail")

    fake.tokenize = broken  # type: ignore[method-assign]
    return await _call(fake, "POST", "/v1/completions", {"model": "fake-chat", "prompt": "x"})


async def not_ready() -> httpx.Response:
    return await _call(FakeConnector(healthy=False), "POST", "/v1/chat/completions", CHAT)


async def shutting_down() -> httpx.Response:
    fake = FakeConnector()
    app = make_app(fake)
    app.state.servelm.ctx.lifecycle.draining = True
    async with make_client(app) as c:
        return await c.post("/v1/chat/completions", json=CHAT)


async def engine_dead() -> httpx.Response:
    return await _call(FakeConnector(healthy=False, fatal="the engine loop died"), "POST", "/v1/chat/completions", CHAT)


async def replica_failed() -> httpx.Response:
    # How the Ray connector gives up on a request (tests/connectors/test_ray_front_end.py
    # produces it through the connector itself).
    error = ConnectorError(
        "The request lost its engine replica 4 times; giving up.",
        status=503,
        type="service_unavailable_error",
        code="replica_failed",
    )
    return await _call(FakeConnector(raise_on_start=error), "POST", "/v1/chat/completions", CHAT)


# (status, type, code) each producer must give.
PRODUCERS: dict[str, tuple[Producer, int, str, str | None]] = {
    "invalid field": (invalid_field, 400, "invalid_request_error", None),
    "invalid tool": (invalid_tool, 400, "invalid_request_error", None),
    "invalid json": (invalid_json, 400, "invalid_request_error", "invalid_json"),
    "context too long": (context_too_long, 400, "invalid_request_error", "context_length_exceeded"),
    "model not supported": (model_not_supported, 400, "invalid_request_error", "model_not_supported"),
    "invalid structured output": (invalid_structured_output, 400, "invalid_request_error", "invalid_structured_output"),
    "bad key": (bad_key, 401, "invalid_request_error", "invalid_api_key"),
    "unknown model": (unknown_model, 404, "invalid_request_error", "model_not_found"),
    "unknown route": (unknown_route, 404, "invalid_request_error", "unknown_url"),
    "wrong method": (wrong_method, 405, "invalid_request_error", "method_not_allowed"),
    "too large": (too_large, 413, "invalid_request_error", "request_too_large"),
    "rate limited": (rate_limited, 429, "requests", "rate_limit_exceeded"),
    "timed out": (timed_out, 408, "timeout_error", "request_timeout"),
    "queue full": (queue_full, 429, "server_overloaded", "queue_full"),
    "queue timeout": (queue_timeout, 429, "server_overloaded", "queue_timeout"),
    "engine error": (engine_error, 500, "server_error", "engine_error"),
    "unexpected": (unexpected, 500, "server_error", None),
    "not ready": (not_ready, 503, "service_unavailable_error", "model_not_ready"),
    "shutting down": (shutting_down, 503, "service_unavailable_error", "server_shutting_down"),
    "engine dead": (engine_dead, 503, "service_unavailable_error", "engine_dead"),
    "replica failed": (replica_failed, 503, "service_unavailable_error", "replica_failed"),
}


def _row_of(status: int, type_: str, code: str | None) -> int | None:
    for i, (statuses, types, codes) in enumerate(documented_rows()):
        if status in statuses and type_ in types and code in codes:
            return i
    return None


@pytest.mark.parametrize("name", list(PRODUCERS))
async def test_each_error_is_sent_as_documented(name):
    produce, status, type_, code = PRODUCERS[name]
    r = await produce()
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == (type_, code), error
    assert "Traceback" not in r.text and "internal detail" not in r.text
    assert _row_of(status, type_, code) is not None, f"{name}: {status} {type_}/{code} is missing from docs/API.md"


def test_every_documented_row_is_produced_by_a_test():
    produced = {_row_of(status, type_, code) for _, status, type_, code in PRODUCERS.values()}
    rows = documented_rows()
    missing = [rows[i] for i in range(len(rows)) if i not in produced]
    assert not missing, f"rows of docs/API.md's error table no test produces: {missing}"


def test_the_shutdown_error_is_the_documented_one():
    # Also sent as a stream's last event when the drain ends; same envelope.
    err = ServerShuttingDown()
    assert (err.status, err.type, err.code) == (503, "service_unavailable_error", "server_shutting_down")
