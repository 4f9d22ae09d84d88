"""The chat page in Chromium against a real ``servelm serve`` on the bundled model."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.e2e.conftest import ServerProcess

from .conftest import ARTIFACTS, WAIT_S, metric, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.model]

TIMEOUT_MS = WAIT_S * 1000


def open_chat(page: Page, server: ServerProcess) -> None:
    page.goto(server.url + "/")
    expect(page.locator("#model option")).to_have_count(1, timeout=TIMEOUT_MS)


def set_max_tokens(page: Page, n: int, temperature: float | None = None) -> None:
    page.get_by_text("Settings").click()
    page.get_by_label("max_tokens").fill(str(n))
    page.get_by_label("max_tokens").dispatch_event("change")
    if temperature is not None:
        page.get_by_label("Temperature").fill(str(temperature))
        page.get_by_label("Temperature").dispatch_event("change")


def reply_text(page: Page) -> str:
    return page.locator(".msg.assistant .content").last.inner_text()


def test_reply_streams_stop_frees_the_request_and_reload_keeps_the_conversation(page: Page, server: ServerProcess):
    open_chat(page, server)
    set_max_tokens(page, 400)
    page.get_by_label("Message").fill("Tell me a long story about a lighthouse keeper.")
    page.get_by_role("button", name="Send").click()
    stop = page.get_by_role("button", name="Stop")
    expect(stop).to_be_enabled()
    expect(page.locator(".msg.user")).to_have_text("Tell me a long story about a lighthouse keeper.")

    # The reply grows while the request is still streaming.
    wait_for(lambda: len(reply_text(page).strip()) > 0, "the first tokens of the reply")
    first = reply_text(page)
    wait_for(lambda: len(reply_text(page)) > len(first), "the reply to grow")
    assert stop.is_enabled(), "the stream ended before it could be seen growing"
    assert metric(server.url, "servelm:num_requests_running") >= 1

    stop.click()
    wait_for(lambda: metric(server.url, "servelm:num_requests_running") == 0, "the server to free the stopped request")
    expect(page.locator(".msg.assistant .stats").last).to_contain_text("stopped")
    expect(page.get_by_role("button", name="Send")).to_be_enabled()
    expect(stop).to_be_disabled()
    stopped_reply = reply_text(page)
    assert stopped_reply.strip()

    page.reload()
    expect(page.locator(".msg.user")).to_have_text("Tell me a long story about a lighthouse keeper.")
    expect(page.locator(".msg.assistant .content")).to_have_text(stopped_reply)
    expect(page.locator(".msg.assistant .stats")).to_contain_text("stopped")


def test_a_finished_reply_shows_ttft_speed_and_token_count_and_can_be_regenerated(page: Page, server: ServerProcess):
    open_chat(page, server)
    # Greedy, so neither the reply nor its regeneration can sample the end-of-text token before 6 tokens.
    set_max_tokens(page, 6, temperature=0)
    page.get_by_label("Message").fill("Say hello.")
    page.get_by_label("Message").press("Enter")  # Enter sends
    stats = page.locator(".msg.assistant .stats")
    expect(stats).to_have_text(
        re.compile(r"TTFT \d+ ms · [\d.]+ tokens/s · 6 tokens · cut at max_tokens"), timeout=TIMEOUT_MS
    )
    assert reply_text(page).strip()
    assert page.locator(".msg.user").count() == 1

    page.get_by_role("button", name="Regenerate").click()
    expect(page.get_by_role("button", name="Stop")).to_be_enabled()
    expect(stats).to_have_count(1)
    expect(stats).to_have_text(re.compile(r"6 tokens · cut at max_tokens"), timeout=TIMEOUT_MS)
    assert page.locator(".msg.user").count() == 1

    page.get_by_role("button", name="New chat").click()
    expect(page.locator(".msg")).to_have_count(0)


def test_the_model_picker_and_settings_go_into_the_request_and_copy_copies_the_reply(page: Page, server: ServerProcess):
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
    served = [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=WAIT_S).json()["data"]]
    open_chat(page, server)
    expect(page.locator("#model option")).to_have_text(served)  # the picker lists /v1/models

    sent: list[dict] = []

    def record(route) -> None:
        sent.append(route.request.post_data_json)
        route.continue_()  # on to the real server

    page.route("**/v1/chat/completions", record)
    page.get_by_text("Settings").click()
    page.get_by_label("System prompt").fill("You answer in one word.")
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("top_p").fill("0.5")
    page.get_by_label("max_tokens").fill("5")
    page.get_by_label("Message").fill("Name a colour.")
    page.get_by_role("button", name="Send").click()
    expect(page.locator(".msg.assistant .stats")).to_contain_text("tokens", timeout=TIMEOUT_MS)

    assert len(sent) == 1
    body = sent[0]
    assert body["model"] == served[0] and body["stream"] is True
    assert body["messages"] == [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour."},
    ]
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0, 0.5, 5)

    # Copy puts the reply's text (its markdown source) on the clipboard.
    stored = page.evaluate("JSON.parse(localStorage.getItem('servelm.chat')).messages.at(-1).content")
    assert stored.strip()
    page.get_by_role("button", name="Copy").click()
    wait_for(lambda: page.evaluate("navigator.clipboard.readText()") == stored, "the reply on the clipboard")

    # The settings are kept with the conversation across a reload.
    page.reload()
    expect(page.get_by_label("System prompt")).to_have_value("You answer in one word.")
    expect(page.get_by_label("Temperature")).to_have_value("0")
    expect(page.get_by_label("top_p")).to_have_value("0.5")
    expect(page.get_by_label("max_tokens")).to_have_value("5")


def test_shift_enter_is_a_new_line_and_enter_sends(page: Page, server: ServerProcess):
    open_chat(page, server)
    set_max_tokens(page, 2)
    box = page.get_by_label("Message")
    box.type("first line")
    box.press("Shift+Enter")
    box.type("second line")
    assert box.input_value() == "first line\nsecond line"
    assert page.locator(".msg").count() == 0
    box.press("Enter")
    expect(page.locator(".msg.user")).to_have_text("first line\nsecond line")
    expect(box).to_have_value("")
    expect(page.locator(".msg.assistant .stats")).to_contain_text("tokens", timeout=TIMEOUT_MS)


def test_errors_are_shown_in_the_conversation(page: Page, server: ServerProcess):
    open_chat(page, server)
    page.get_by_text("Settings").click()
    # 400 from the real server: a top_p outside (0, 1].
    page.get_by_label("top_p").fill("5")
    page.get_by_label("Message").fill("Hi")
    page.get_by_role("button", name="Send").click()
    expect(page.locator(".msg.error")).to_contain_text("Error 400", timeout=TIMEOUT_MS)
    expect(page.locator(".msg.error")).to_contain_text("top_p")
    page.get_by_label("top_p").fill("1")

    # 429 as the rate limiter sends it, and a dropped connection: the page shows both.
    body = {
        "error": {
            "message": "Rate limit reached for requests",
            "type": "rate_limit_error",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=429, headers={"retry-after": "3", "content-type": "application/json"}, body=json.dumps(body)
        ),
    )
    page.get_by_label("Message").fill("Hi again")
    page.get_by_role("button", name="Send").click()
    expect(page.locator(".msg.error").last).to_have_text(
        "Too many requests (429): Rate limit reached for requests Retry after 3 s."
    )
    page.unroute("**/v1/chat/completions")
    page.route("**/v1/chat/completions", lambda route: route.abort("connectionreset"))
    page.get_by_label("Message").fill("And again")
    page.get_by_role("button", name="Send").click()
    expect(page.locator(".msg.error").last).to_contain_text("Network error")
    expect(page.get_by_role("button", name="Send")).to_be_enabled()


def test_an_html_reply_stays_inert(page: Page, server: ServerProcess):
    """Model output carrying markup is sanitized: no handler runs, no such element reaches the DOM."""
    open_chat(page, server)
    attack = (
        'Sure! <img src=x onerror="window.__xss = (window.__xss || 0) + 1"> '
        "<script>window.__xss = (window.__xss || 0) + 1</script>"
        '<a href="javascript:window.__xss=1">click</a> **bold**'
    )
    # A reply the page stored, drawn by the page's own code on load...
    conversation = {
        "messages": [
            {"role": "user", "content": '<img src=x onerror="window.__xss=1">'},
            {"role": "assistant", "content": attack},
        ],
        "settings": {},
    }
    page.evaluate("(c) => localStorage.setItem('servelm.chat', JSON.stringify(c))", conversation)
    page.reload()
    expect(page.locator(".msg.assistant strong")).to_have_text("bold")
    # ...and the same text fed through the renderer module the stream uses.
    page.evaluate(
        """async (text) => {
      const { renderInto } = await import('/static/js/render.js');
      const el = document.createElement('div');
      el.id = 'rendered';
      document.body.append(el);
      renderInto(el, text);
    }""",
        attack,
    )
    page.wait_for_load_state("networkidle")
    assert page.evaluate("window.__xss") is None
    assert page.locator("img[onerror], script:not([type=module]), a[href^=javascript]").count() == 0
    assert page.locator(".msg.user").inner_text() == '<img src=x onerror="window.__xss=1">'  # user text shown as text
    assert "click" in page.locator("#rendered").inner_text()


def test_the_page_works_at_phone_width(browser, server: ServerProcess, request):
    context = browser.new_context(viewport={"width": 390, "height": 780}, is_mobile=True, has_touch=True)
    page = context.new_page()
    try:
        open_chat(page, server)
        for name in ("Send", "Stop", "New chat"):
            box = page.get_by_role("button", name=name).bounding_box()
            assert box and box["x"] >= 0 and box["x"] + box["width"] <= 390, name
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        expect(page.get_by_label("Message")).to_be_visible()
    finally:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"), timeout=TIMEOUT_MS)
        context.close()


def test_dark_and_light_follow_the_system(browser, server: ServerProcess, request):
    ARTIFACTS.mkdir(exist_ok=True)
    colours = {}
    for scheme in ("light", "dark"):
        context = browser.new_context(color_scheme=scheme)
        page = context.new_page()
        try:
            page.goto(server.url + "/")
            colours[scheme] = page.evaluate("getComputedStyle(document.body).backgroundColor")
        finally:
            page.screenshot(path=str(ARTIFACTS / f"{request.node.name}_{scheme}.png"), timeout=TIMEOUT_MS)
            context.close()
    assert colours["light"] == "rgb(255, 255, 255)"
    assert colours["dark"] != colours["light"]
