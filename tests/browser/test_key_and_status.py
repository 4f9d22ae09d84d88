"""The API-key prompt against a server started with --api-key, and the live status page under load."""

from __future__ import annotations

import json
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


def _metrics_text(uptime: float, tokens: int, rejected: int, ttft: tuple[int, int, int]) -> str:
    """A /metrics answer: uptime, counters, and TTFT buckets (<= 0.1 s, <= 0.5 s, all)."""
    fast, medium, total = ttft
    return (
        f"servelm:uptime_seconds {uptime}\n"
        f'servelm:generation_tokens_total{{model_name="m"}} {tokens}\n'
        f'servelm:http_requests_total{{method="POST",route="/v1/chat/completions",status="429"}} {rejected}\n'
        f'servelm:time_to_first_token_seconds_bucket{{le="0.1",model_name="m"}} {fast}\n'
        f'servelm:time_to_first_token_seconds_bucket{{le="0.5",model_name="m"}} {medium}\n'
        f'servelm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m"}} {total}\n'
        f'servelm:time_to_first_token_seconds_count{{model_name="m"}} {total}\n'
    )


def test_the_status_page_starts_its_rates_again_after_a_restart_and_leaves_a_gap_for_an_outage(page: Page, server):
    answers = [
        _metrics_text(100, 5000, 7, (0, 10, 10)),  # a server up for a while
        _metrics_text(101, 5100, 9, (0, 10, 10)),
        None,  # down
        _metrics_text(1, 0, 0, (0, 0, 0)),  # back, restarted: every counter from 0
        _metrics_text(2, 50, 1, (0, 4, 4)),  # 4 first tokens in (0.1 s, 0.5 s]: p50 300 ms
    ]

    def answer(route) -> None:
        text = answers.pop(0) if len(answers) > 1 else answers[0]
        if text is None:
            route.abort("connectionrefused")
        else:
            route.fulfill(status=200, headers={"content-type": "text/plain"}, body=text)

    page.route("**/metrics", answer)
    page.goto(server.url + "/status")
    wait_for(lambda: _scrapes(page) >= 5, "five scrapes")
    columns = page.evaluate("async () => (await import('/static/js/status.js')).columns")
    tokens_per_s, rejected_per_s, ttft_p50 = columns[0][1], columns[5][1], columns[3][1]
    # First scrape: no rate yet; then the old server's rate; a gap for the failed scrape; no rate
    # across the restart (it would be negative); then the new server's own.
    assert [v is None for v in tokens_per_s[:5]] == [True, False, True, True, False], tokens_per_s
    assert all(v >= 0 for v in tokens_per_s + rejected_per_s if v is not None), (tokens_per_s, rejected_per_s)
    assert rejected_per_s[4] > 0
    assert ttft_p50[-1] == pytest.approx(300)  # the new server's first tokens only
    expect(page.locator("#v-ttft")).to_have_text("300 / 480 ms")
    expect(page.locator("#state")).to_have_text("live")


def _require_key_on_metrics(page: Page) -> list[str | None]:
    """/metrics answers 401 without the key, as with --metrics-require-auth; returns the Authorization headers seen."""
    seen: list[str | None] = []
    body = {
        "error": {"message": "Incorrect API key provided.", "type": "invalid_request_error", "code": "invalid_api_key"}
    }

    def answer(route) -> None:
        seen.append(route.request.headers.get("authorization"))
        if seen[-1] == f"Bearer {KEY}":
            route.continue_()
        else:
            route.fulfill(status=401, headers={"content-type": "application/json"}, body=json.dumps(body))

    page.route("**/metrics", answer)
    return seen


def test_cancelling_the_key_dialog_on_the_status_page_stops_the_asking(page: Page, server: ServerProcess):
    seen = _require_key_on_metrics(page)
    page.goto(server.url + "/status")
    dialog = page.get_by_role("dialog")
    expect(dialog).to_be_visible(timeout=TIMEOUT_MS)
    page.get_by_role("button", name="Cancel").click()
    expect(dialog).to_be_hidden()
    expect(page.locator("#state")).to_have_text("error 401: Incorrect API key provided.")
    key_button = page.get_by_role("button", name="Enter API key")
    expect(key_button).to_be_visible()

    # The page goes on checking (slowly) whether /metrics still needs a key, but does not ask again.
    asked = len(seen)
    wait_for(lambda: dialog.is_visible() or len(seen) >= asked + 2, "two more scrapes, or the dialog")
    expect(dialog).to_be_hidden()

    key_button.click()
    expect(dialog).to_be_visible()
    page.get_by_label("API key").fill(KEY)
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#state")).to_have_text("live", timeout=TIMEOUT_MS)
    expect(key_button).to_be_hidden()
    expect(page.locator("#model")).to_have_text(CHAT_MODEL)


def test_the_status_page_says_when_the_server_does_not_answer(page: Page, server: ServerProcess):
    hang = threading.Event()
    page.route("**/metrics", lambda route: None if hang.is_set() else route.continue_())  # a hung one is never answered
    page.goto(server.url + "/status")
    expect(page.locator("#state")).to_have_text("live", timeout=TIMEOUT_MS)
    hang.set()
    expect(page.locator("#state")).to_have_text("the server is not answering (no reply in 5 s)", timeout=TIMEOUT_MS)
    hang.clear()
    expect(page.locator("#state")).to_have_text("live", timeout=TIMEOUT_MS)
