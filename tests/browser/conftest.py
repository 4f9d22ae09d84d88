"""Browser fixtures: Playwright driving Debian's Chromium against a real ``servelm serve``.

The browser is the system one (``make setup`` installs Debian's ``chromium``);
nothing downloads a browser build. When it is missing these tests fail, they
never skip: the pages would otherwise ship untested.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, Playwright, sync_playwright

from tests.e2e.conftest import ServerProcess, server_process

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",  # tests run as root in containers, where Chromium's sandbox cannot start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
WAIT_S = 120.0  # safety net for states reached on a loaded machine; tests wait on states, never on time


# Module-scoped, not session-scoped: Playwright's sync API runs an event loop in
# this thread while it is open, and pytest-asyncio tests collected after the
# browser tests (tests/connectors, tests/engine...) could not start their own.
@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make browser` (Debian's chromium package)")
    browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
    yield browser
    browser.close()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One real server for a test module (starting one takes seconds)."""
    with server_process(["--embedding-model", "none"]) as proc:
        yield proc


@pytest.fixture
def page(browser: Browser, request: pytest.FixtureRequest) -> Iterator[Page]:
    """A fresh browser context (empty localStorage); a screenshot of the page as the test ends."""
    context = browser.new_context(viewport={"width": 1100, "height": 800})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.errors = errors  # type: ignore[attr-defined]
    yield page
    ARTIFACTS.mkdir(exist_ok=True)
    name = re.sub(r"[^\w.-]+", "_", request.node.name)
    try:
        page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True, timeout=WAIT_S * 1000)
    finally:
        context.close()


def metric(url: str, name: str) -> float:
    """The sum of one metric's samples in the server's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    """Poll ``condition`` until true; fail with ``what`` after the safety-net timeout."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)
