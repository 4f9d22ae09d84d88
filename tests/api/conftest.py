"""Fixtures for the API tests: a fake connector, an app around it, clients."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from servelm.api import create_app
from servelm.settings import Settings

from .fake_connector import FakeConnector

CREATED = 1700000000


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Settings read SERVELM_* variables; the developer's shell must not leak in.
    for name in list(os.environ):
        if name.upper().startswith("SERVELM_"):
            monkeypatch.delenv(name)


def make_app(fake: FakeConnector, **settings: object):
    """An app with reproducible ids ("test") and timestamps."""
    return create_app(fake, Settings(**settings), clock=lambda: CREATED, new_id=lambda: "test")


def make_client(app, **kwargs: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver", **kwargs)


@pytest.fixture
def fake() -> FakeConnector:
    return FakeConnector()


@pytest.fixture
def app(fake: FakeConnector):
    return make_app(fake)


@pytest.fixture
async def client(app) -> AsyncIterator[httpx.AsyncClient]:
    async with make_client(app) as c:
        yield c


class ThreadedServer:
    """The real uvicorn server (as the CLI builds it) on a free port, in a thread."""

    def __init__(self, app, **settings: object):
        from servelm.server import ServelmServer

        self.server = ServelmServer(app, Settings(port=0, log_level="warning", **settings))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        # Waits for the server's own "started" state; the deadline is only a
        # safety net for a server that hangs, generous for a busy machine.
        deadline = time.monotonic() + 120
        while not self.server.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self.server.url

    def __exit__(self, *exc: object) -> None:
        self.server.server.should_exit = True
        self.thread.join(timeout=60)


@pytest.fixture
def live_server(fake: FakeConnector) -> Iterator[str]:
    """Base URL of a uvicorn server around a fresh fake connector."""
    with ThreadedServer(make_app(fake)) as url:
        yield url
