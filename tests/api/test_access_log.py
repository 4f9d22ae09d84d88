"""Request ids (x-request-id) and the access log, as text and as JSON lines."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys

import httpx
import pytest

from servelm.api import create_app
from servelm.api.access_log import ACCESS_LOGGER, JsonFormatter
from servelm.settings import Settings

from .conftest import make_app, make_client
from .fake_connector import encode

CHAT = {"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": 20}
PROMPT_TOKENS = len(encode("<|user|>x\n<|assistant|>", add_special_tokens=False))
REPLY_TOKENS = len(encode("Hello world", add_special_tokens=False))


@pytest.fixture
def access(caplog: pytest.LogCaptureFixture):
    """The access records logged during the test, as their field dicts."""
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)

    def records() -> list[dict]:
        return [r.access for r in caplog.records if r.name == ACCESS_LOGGER]

    return records


async def test_the_clients_request_id_is_echoed(client):
    r = await client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "trace-42/a"})
    assert r.headers["x-request-id"] == "trace-42/a"
    assert r.json()["id"] == "chatcmpl-test"  # response ids stay unique: built from the server's own id


async def test_a_generated_id_joins_the_response_id(fake):
    async with make_client(create_app(fake, Settings())) as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
        request_id = r.headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", request_id)
        assert r.json()["id"] == f"chatcmpl-{request_id}"
        r = await c.post("/v1/completions", json={"model": "fake-chat", "prompt": "x", "max_tokens": 2})
        assert r.json()["id"] == f"cmpl-{r.headers['x-request-id']}"
        other = (await c.get("/v1/models")).headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", other) and other != request_id


@pytest.mark.parametrize("sent", ["", "has space", "x" * 129, "caf\u00e9"])
async def test_an_unusable_request_id_is_replaced(fake, sent):
    async with make_client(make_app(fake)) as c:
        r = await c.get("/v1/models", headers={"x-request-id": sent.encode("utf-8")})
    assert r.headers["x-request-id"] == "test"


async def test_every_response_carries_the_id(fake):
    async with make_client(make_app(fake, api_keys=["k"], max_body_bytes=10)) as c:
        headers = {"x-request-id": "rid"}
        assert (await c.get("/health", headers=headers)).headers["x-request-id"] == "rid"  # open route
        r = await c.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert (r.status_code, r.headers["x-request-id"]) == (401, "rid")
        auth = {**headers, "Authorization": "Bearer k"}
        r = await c.post("/v1/chat/completions", json=CHAT, headers=auth)
        assert (r.status_code, r.headers["x-request-id"]) == (413, "rid")
        r = await c.get("/nowhere", headers=auth)
        assert (r.status_code, r.headers["x-request-id"]) == (404, "rid")


async def test_one_line_per_request_with_its_fields(client, access):
    r = await client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "abc"})
    assert r.status_code == 200
    (line,) = access()
    assert line["duration_s"] >= 0
    assert {k: v for k, v in line.items() if k != "duration_s"} == {
        "request_id": "abc",
        "method": "POST",
        "path": "/v1/chat/completions",
        "route": "/v1/chat/completions",
        "status": 200,
        "client": "127.0.0.1",
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": REPLY_TOKENS,
        "ttft_s": None,  # only streams have a first token the client sees early
    }


async def test_a_stream_is_logged_once_it_ends_with_its_ttft(client, access, caplog):
    body = {**CHAT, "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        text = (await r.aread()).decode()
    assert text.endswith("data: [DONE]\n\n")
    (line,) = access()
    assert (line["status"], line["prompt_tokens"], line["completion_tokens"]) == (200, PROMPT_TOKENS, REPLY_TOKENS)
    assert 0 <= line["ttft_s"] <= line["duration_s"]
    (record,) = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    message = record.getMessage()
    assert message.startswith('test 127.0.0.1 "POST /v1/chat/completions" 200 ')
    assert f"prompt_tokens={PROMPT_TOKENS} completion_tokens={REPLY_TOKENS} ttft=" in message
    assert re.search(r"ttft=[0-9.e-]+s total=[0-9.e-]+s$", message)


async def test_embeddings_and_other_routes(client, access):
    await client.post("/v1/embeddings", json={"model": "fake-embed", "input": ["ab", "c"]})
    await client.get("/v1/models/fake-chat")
    await client.get("/nowhere")
    await client.post("/v1/chat/completions", json={"model": "fake-chat"})
    lines = access()
    assert [(e["route"], e["status"], e["prompt_tokens"], e["completion_tokens"]) for e in lines] == [
        ("/v1/embeddings", 200, 5, None),
        ("/v1/models/{model_id:path}", 200, None, None),
        ("unmatched", 404, None, None),
        ("/v1/chat/completions", 400, None, None),
    ]
    assert lines[2]["path"] == "/nowhere"


async def test_rejected_requests_are_logged(fake, access):
    app = make_app(fake, api_keys=["k"], rate_limits={"default": {"requests_per_minute": 1}})
    auth = {"Authorization": "Bearer k"}
    async with make_client(app) as c:
        await c.post("/v1/chat/completions", json=CHAT)
        await c.post("/v1/chat/completions", json=CHAT, headers=auth)
        await c.post("/v1/completions", json={"model": "fake-chat", "prompt": "x", "max_tokens": 2}, headers=auth)
    assert [(e["route"], e["status"]) for e in access()] == [
        ("/v1/chat/completions", 401),
        ("/v1/chat/completions", 200),
        ("/v1/completions", 429),  # the same key, over its one request a minute
    ]


async def test_an_engine_failure_is_logged_as_500(fake, access):
    fake.raise_on_start = RuntimeError("boom")
    async with make_client(make_app(fake)) as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 500 and r.headers["x-request-id"] == "test"
    (line,) = access()
    assert (line["status"], line["prompt_tokens"], line["completion_tokens"]) == (500, PROMPT_TOKENS, 0)


async def test_json_lines_parse(fake):
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger(ACCESS_LOGGER)
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        async with make_client(make_app(fake)) as c:
            await c.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-request-id": "j1"})
            await c.get("/v1/models", headers={"x-request-id": 'j"2'})
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    first, second = [json.loads(line) for line in out.getvalue().splitlines()]
    assert first["level"] == "info" and first["logger"] == ACCESS_LOGGER
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", first["time"])
    assert (first["request_id"], first["status"], first["completion_tokens"]) == ("j1", 200, REPLY_TOKENS)
    assert first["ttft_s"] is not None and first["message"].startswith("j1 ")
    assert (second["request_id"], second["route"]) == ('j"2', "/v1/models")


def test_log_format_json_configures_the_process():
    code = (
        "import logging; from servelm.api.access_log import configure_logging\n"
        "configure_logging('info', 'json')\n"
        "logging.getLogger('uvicorn.error').info('Started %s', 'server')\n"
        "try:\n    1 / 0\nexcept ZeroDivisionError:\n    logging.getLogger('servelm.api').exception('failed')\n"
        "logging.getLogger('servelm').debug('hidden')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = [json.loads(line) for line in run.stderr.splitlines()]
    assert [(e["level"], e["logger"], e["message"]) for e in lines] == [
        ("info", "uvicorn.error", "Started server"),
        ("error", "servelm.api", "failed"),
    ]
    assert "ZeroDivisionError" in lines[1]["exception"]


def test_the_server_leaves_access_logging_to_servelm():
    from servelm.server import ServelmServer

    app = create_app(_NoConnector(), Settings())
    text_server = ServelmServer(app, Settings(port=0))
    assert text_server.config.access_log is False and text_server.config.log_config is not None
    json_server = ServelmServer(app, Settings(port=0, log_format="json"))
    assert json_server.config.log_config is None  # uvicorn's lines reach the JSON handler


class _NoConnector:
    """Enough of a connector to build an app that never serves a request."""


async def test_a_live_server_returns_and_logs_the_id(live_server, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    async with httpx.AsyncClient(base_url=live_server) as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"X-Request-ID": "live-1"})
    assert r.headers["x-request-id"] == "live-1"
    (record,) = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    assert record.access["request_id"] == "live-1" and record.access["status"] == 200
