"""A client that goes away aborts its engine request, streamed or not."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx

from servelm.api.access_log import ACCESS_LOGGER

from .conftest import ThreadedServer, make_app

CHAT = {"model": "fake-chat", "messages": [{"role": "user", "content": "x"}]}


async def drive(app, path: str, body: dict, disconnect: asyncio.Event) -> list[dict]:
    """Call the ASGI app as a server would; the client disconnects when ``disconnect`` is set."""
    raw = json.dumps(body).encode()
    delivered = False
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=60)  # a safety net: the call ends on its own
    return sent


async def disconnect_when_held(fake, app, path, body) -> list[dict]:
    disconnect = asyncio.Event()
    task = asyncio.create_task(drive(app, path, body, disconnect))
    await asyncio.wait_for(fake.held.wait(), timeout=60)
    disconnect.set()
    return await task


async def test_streaming_disconnect_aborts(fake):
    fake.hold_after = 2
    sent = await disconnect_when_held(fake, make_app(fake), "/v1/chat/completions", {**CHAT, "stream": True})
    assert fake.aborted == ["chatcmpl-test"]
    assert sent[0]["status"] == 200
    bodies = b"".join(m.get("body", b"") for m in sent[1:])
    assert b'"content":"e"' in bodies and b"[DONE]" not in bodies


async def test_non_streaming_disconnect_aborts(fake):
    fake.hold_after = 1
    sent = await disconnect_when_held(fake, make_app(fake), "/v1/chat/completions", CHAT)
    assert fake.aborted == ["chatcmpl-test"]
    assert sent[0]["status"] == 499


async def test_disconnect_aborts_every_prompt(fake):
    fake.hold_after = 1
    body = {"model": "fake-chat", "prompt": ["a", "b"], "stream": True}
    await disconnect_when_held(fake, make_app(fake), "/v1/completions", body)
    assert sorted(fake.aborted) == ["cmpl-test-0", "cmpl-test-1"]


async def test_metrics_count_a_disconnect_as_an_abort(fake):
    fake.hold_after = 1
    app = make_app(fake)
    await disconnect_when_held(fake, app, "/v1/chat/completions", {**CHAT, "stream": True})
    text = app.state.servelm.ctx.metrics.render().decode()
    assert 'servelm:request_success_total{finished_reason="abort",model_name="fake-chat"} 1.0' in text
    # An aborted request has no end-to-end latency.
    assert "servelm:e2e_request_latency_seconds_count{" not in text


def test_real_socket_disconnect_aborts(fake):
    fake.hold_after = 2
    with ThreadedServer(make_app(fake)) as url:
        with httpx.Client(base_url=url, timeout=60) as client:
            with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert '"role":"assistant"' in first
            # leaving the block closes the connection mid-stream
        deadline = time.monotonic() + 60  # a safety net; the abort comes as soon as the server notices
        while not fake.aborted and time.monotonic() < deadline:
            time.sleep(0.02)
    assert fake.aborted == ["chatcmpl-test"]


async def test_an_aborted_stream_is_logged_and_counted_as_499(fake, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    fake.hold_after = 2
    app = make_app(fake)
    sent = await disconnect_when_held(fake, app, "/v1/chat/completions", {**CHAT, "stream": True})
    assert sent[0]["status"] == 200  # on the wire the stream had begun
    (line,) = [r.access for r in caplog.records if r.name == ACCESS_LOGGER]
    assert line["status"] == 499
    text = app.state.servelm.ctx.metrics.render().decode()
    assert 'servelm:http_requests_total{method="POST",route="/v1/chat/completions",status="499"} 1.0' in text
    assert 'status="200"' not in text


async def test_a_finished_stream_is_logged_200(fake, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    never = asyncio.Event()  # the client stays to the end
    await drive(make_app(fake), "/v1/chat/completions", {**CHAT, "stream": True}, never)
    (line,) = [r.access for r in caplog.records if r.name == ACCESS_LOGGER]
    assert line["status"] == 200
