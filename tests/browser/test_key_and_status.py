"""The API-key prompt against a server started with --api-key, and the live status page under load."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.e2e.conftest import CHAT_MODEL, ServerProcess, server_process

from .conftest import WAIT_S, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.model]

TIMEOUT_MS = WAIT_S * 1000
KEY = "sk-browser-test"
FLOOD_KEY = "sk-browser-flood"  # a second client, sent past its rate limit
RPM = 20  # per key: far above what KEY's tests send in a minute


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One server with auth and a rate limit on: the pages must still load, and ask for the key."""
    args = ["--embedding-model", "none", "--api-key", KEY, "--api-key", FLOOD_KEY, "--rate-limit-rpm", str(RPM)]
    with server_process(args) as proc:
        yield proc


def test_the_page_asks_for_the_key_keeps_it_and_sends_it(page: Page, server: ServerProcess):
    page.goto(server.url + "/")
    dialog = page.get_by_role("dialog")
    expect(dialog).to_be_visible(timeout=TIMEOUT_MS)
    expect(dialog).to_contain_text("The server needs an API key")

    # A wrong key: the server's 401 is shown, and the prompt comes back.
    page.get_by_label("API key").fill("sk-wrong")
    page.get_by_role("button", name="Save").click()
    expect(dialog).to_be_visible(timeout=TIMEOUT_MS)
    expect(dialog).to_contain_text("Incorrect API key provided")

    page.get_by_label("API key").fill(KEY)
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#model option")).to_have_text([CHAT_MODEL], timeout=TIMEOUT_MS)
    assert page.evaluate("localStorage.getItem('servelm.apiKey')") == KEY

    page.get_by_text("Settings").click()
    page.get_by_label("max_tokens").fill("3")
    page.get_by_label("Temperature").fill("0")  # greedy: no sampled end-of-text before 3 tokens
    page.get_by_label("Message").fill("Hi")
    page.get_by_role("button", name="Send").click()
    expect(page.locator(".msg.assistant .stats")).to_contain_text("3 tokens", timeout=TIMEOUT_MS)

    # Kept across reloads: no prompt the second time.
    page.reload()
    expect(page.locator("#model option")).to_have_text([CHAT_MODEL], timeout=TIMEOUT_MS)
    expect(dialog).to_be_hidden()


def test_a_revoked_key_shows_the_401_in_the_conversation(page: Page, server: ServerProcess):
    page.goto(server.url + "/")
    page.evaluate(f"localStorage.setItem('servelm.apiKey', '{KEY}')")
    page.reload()
    expect(page.locator("#model option")).to_have_count(1, timeout=TIMEOUT_MS)
    page.evaluate("localStorage.setItem('servelm.apiKey', 'sk-revoked')")
    page.get_by_label("Message").fill("Hi")
    page.get_by_role("button", name="Send").click()
    expect(page.locator(".msg.error")).to_have_text("Error 401: Incorrect API key provided.", timeout=TIMEOUT_MS)
    expect(page.get_by_role("dialog")).to_be_visible()


def _scrapes(page: Page) -> int:
    return int(page.get_attribute("body", "data-scrapes") or 0)


def test_the_status_page_draws_live_charts_that_move_under_load(page: Page, server: ServerProcess):
    # /metrics is open by default even with auth on, as Prometheus scrapers expect.
    page.goto(server.url + "/status")
    wait_for(lambda: _scrapes(page) >= 2, "two scrapes of /metrics")
    expect(page.locator("#model")).to_have_text(CHAT_MODEL)
    expect(page.locator("#dtype")).to_have_text("float32")
    expect(page.locator("#device")).to_have_text("cpu")
    expect(page.locator("#kv-size")).to_have_text(re.compile(r"^[\d,]+ tokens \([\d.]+ MiB\)$"))
    expect(page.locator("#uptime")).to_have_text(re.compile(r"\d+m \d+s"))
    expect(page.locator(".chart canvas")).to_have_count(6)
    expect(page.locator("#v-running")).to_have_text("0")

    # Load: two streams of the real model, sent straight to the server.
    done = threading.Event()

    def load() -> None:
        body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Count to fifty."}], "max_tokens": 40}
        with httpx.Client(timeout=WAIT_S, headers={"Authorization": f"Bearer {KEY}"}) as client:
            for _ in range(2):
                client.post(server.url + "/v1/chat/completions", json=body)
        done.set()

    threads = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    expect(page.locator("#v-running")).not_to_have_text("0", timeout=TIMEOUT_MS)
    expect(page.locator("#v-tokens")).not_to_have_text(re.compile(r"^(–|0\.0)$"), timeout=TIMEOUT_MS)
    expect(page.locator("#v-itl")).to_have_text(re.compile(r"^\d+ / \d+ ms$"), timeout=TIMEOUT_MS)
    for t in threads:
        t.join(WAIT_S)
    # The load is over: the figures fall back.
    wait_for(lambda: _scrapes(page) >= 4, "more scrapes")
    expect(page.locator("#v-running")).to_have_text("0", timeout=TIMEOUT_MS)
    expect(page.locator("#v-ttft")).to_have_text(re.compile(r"^(\d+|–) / (\d+|–) ms$"))

    # Another client past its rate limit: empty bodies (400s, no model work) until the 429s.
    expect(page.locator("#v-rejected")).to_have_text("0")
    with httpx.Client(timeout=WAIT_S, headers={"Authorization": f"Bearer {FLOOD_KEY}"}) as client:
        codes = [client.post(server.url + "/v1/chat/completions", json={}).status_code for _ in range(RPM + 5)]
    assert set(codes) == {400, 429} and codes.count(429) >= 1, codes
    expect(page.locator("#v-rejected")).to_have_text(str(codes.count(429)), timeout=TIMEOUT_MS)
    assert page.locator("#state").inner_text() == "live"
    assert not [e for e in page.errors if "favicon" not in e], page.errors  # type: ignore[attr-defined]
