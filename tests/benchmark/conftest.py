"""Fixtures for the benchmark tests: servelm's own API app on a fake connector, served by uvicorn."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from api.conftest import ThreadedServer
from api.fake_connector import FakeConnector

from servelm.api import create_app
from servelm.connectors.base import ConnectorError
from servelm.engine.outputs import RequestOutput
from servelm.settings import Settings

# Longer than any output a test asks for, so every reply runs to max_tokens.
LONG_REPLY = "abcdefghij" * 30


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Settings and the benchmark's --api-key default read these; the shell must not leak in.
    for name in list(os.environ):
        if name.upper().startswith("SERVELM_") or name == "OPENAI_API_KEY":
            monkeypatch.delenv(name)


@dataclass
class PacedFake(FakeConnector):
    """The API tests' fake, one token per ``step_delay`` seconds, failing calls as ``pattern`` says.

    ``pattern`` cycles over generate calls: "ok", "429" (rate limited before
    the stream starts), "500" (the engine raises) or "stream" (an error event
    after two tokens).
    """

    reply_text: str = LONG_REPLY
    max_model_len: int = 4096
    step_delay: float = 0.001
    pattern: list[str] = field(default_factory=lambda: ["ok"])
    calls: int = 0

    async def _generate(self, model, request_id, prompt, params):
        action = self.pattern[self.calls % len(self.pattern)]
        self.calls += 1
        if action == "429":
            raise ConnectorError(
                "Too many requests, slow down.", status=429, type="rate_limit_error", code="rate_limited"
            )
        if action == "500":
            raise RuntimeError("engine exploded")
        sent = 0
        async for out in super()._generate(model, request_id, prompt, params):
            if action == "stream" and sent == 2:
                yield RequestOutput(request_id, None, out.prompt_token_ids, [], finished=True, delta=True, error="boom")
                return
            await asyncio.sleep(self.step_delay)
            yield out
            sent += 1


@pytest.fixture
def serve_fake() -> Iterator[Callable[..., str]]:
    """Start a server around a given fake (and settings); returns its base URL. Stopped after the test."""
    servers: list[ThreadedServer] = []

    def start(fake: FakeConnector, **settings: object) -> str:
        server = ThreadedServer(create_app(fake, Settings(**settings)), **settings)
        url = server.__enter__()
        servers.append(server)
        return url

    yield start
    for server in servers:
        server.__exit__(None, None, None)
