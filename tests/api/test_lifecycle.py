"""Readiness and the drain on SIGTERM, on a real uvicorn server around the fake connector."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from .conftest import ThreadedServer, make_app, make_client
from .fake_connector import FakeConnector
from .test_chat import chunks

CHAT = {"model": "fake-chat", "messages": [{"role": "user", "content": "x"}]}


class Draining(ThreadedServer):
    """A served fake; ``sigterm()`` runs the server's SIGTERM handler as the signal would."""

    def sigterm(self) -> None:
        self.server.server.handle_exit(signal.SIGTERM, None)

    def release(self, fake: FakeConnector) -> None:
        # The fake's event belongs to the server's loop.
        self.server.server._loop.call_soon_threadsafe(fake.release.set)

    def wait_stopped(self) -> None:
        self.thread.join(timeout=SAFETY_NET_S)
        assert not self.thread.is_alive()


def in_thread(fn) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    return thread, result


# Waits below are for states and events; their timeouts are only safety nets for
# a hung server, generous so that a busy machine never trips them.
SAFETY_NET_S = 120.0


def wait_for(predicate, timeout: float = SAFETY_NET_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def stream_chat(url: str) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=SAFETY_NET_S) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "stream": True})
        r.read()
        return r


def test_ready_and_health_while_loading():
    fake = FakeConnector(healthy=False)
    with ThreadedServer(make_app(fake)) as url:
        for probe in ("/health", "/ready"):
            r = httpx.get(url + probe)
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
            assert r.headers["retry-after"]
        fake.healthy = True
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/ready").json() == {"status": "ready"}


async def test_health_and_requests_after_the_engine_died():
    # The app alone: the real server's watchdog stops it within half a second of the death (the test below),
    # and on a busy machine that came before these requests.
    fake = FakeConnector()
    async with make_client(make_app(fake)) as client:
        fake.healthy, fake.fatal = False, "the engine loop died: RuntimeError('boom')"
        r = await client.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert "boom" not in r.text and "RuntimeError" not in r.text  # internals stay in the log
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_server_stops_with_status_1_when_the_engine_dies():
    fake = FakeConnector()
    srv = Draining(make_app(fake))
    with srv as url:
        assert httpx.get(url + "/health").status_code == 200
        fake.healthy, fake.fatal = False, "the engine loop died"
        srv.wait_stopped()
    assert srv.server.exit_code == 1 and srv.server.fatal_error == "the engine loop died"


def test_sigterm_refuses_new_work_and_lets_streams_finish():
    fake = FakeConnector(hold_after=2)
    srv = Draining(make_app(fake), shutdown_timeout=SAFETY_NET_S)  # the drain ends when the stream does
    with srv as url:
        thread, result = in_thread(lambda: stream_chat(url))
        wait_for(fake.held.is_set)
        srv.sigterm()
        wait_for(lambda: httpx.get(url + "/ready").status_code == 503)
        r = httpx.get(url + "/ready")
        assert r.json()["error"]["code"] == "server_shutting_down" and r.headers["retry-after"] == "5"
        assert httpx.get(url + "/health").status_code == 200  # draining is not ill health
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"] == {
            "message": r.json()["error"]["message"],
            "type": "service_unavailable_error",
            "param": None,
            "code": "server_shutting_down",
        }
        assert thread.is_alive()  # the stream in flight is still being served
        srv.release(fake)
        thread.join(timeout=SAFETY_NET_S)
        srv.wait_stopped()
    body = chunks(result[0].text)  # ends with [DONE]
    assert body[-1]["choices"][0]["finish_reason"] == "stop"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in body) == "Hello world"
    assert fake.aborted == []
    assert srv.server.exit_code == 0


@pytest.mark.parametrize("stream", [True, False])
def test_sigterm_aborts_what_outlives_the_shutdown_timeout(stream):
    fake = FakeConnector(hold_after=1)
    srv = Draining(make_app(fake), shutdown_timeout=0.2)
    with srv as url:
        if stream:
            thread, result = in_thread(lambda: stream_chat(url))
        else:
            thread, result = in_thread(
                lambda: httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=SAFETY_NET_S)
            )
        wait_for(fake.held.is_set)
        srv.sigterm()
        thread.join(timeout=SAFETY_NET_S)
        srv.wait_stopped()
    r = result[0]
    if stream:
        assert r.status_code == 200
        assert chunks(r.text)[-1]["error"]["code"] == "server_shutting_down"  # then [DONE]
    else:
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
    assert fake.aborted == ["chatcmpl-test"]
    assert srv.server.exit_code == 0
