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


def _sent_messages(page: Page) -> list[list[dict]]:
    """The `messages` of every chat request the page makes from now on."""
    sent: list[list[dict]] = []
    page.on(
        "request", lambda r: sent.append(r.post_data_json["messages"]) if r.url.endswith("/chat/completions") else None
    )
    return sent


def _stored(page: Page) -> list[dict]:
    return page.evaluate("JSON.parse(localStorage.getItem('servelm.chat')).messages")


def test_a_message_that_fails_goes_back_to_the_composer_and_is_not_sent_again(page: Page, server: ServerProcess):
    open_chat(page, server)
    sent = _sent_messages(page)
    box = page.get_by_label("Message")
    page.get_by_text("Settings").click()
    page.get_by_label("top_p").fill("5")  # a 400 from the real server
    box.fill("Hi")
    page.get_by_role("button", name="Send").click()
    expect(page.locator(".msg.error")).to_contain_text("Error 400", timeout=TIMEOUT_MS)
    # The message that got no reply is out of the conversation and back in the composer.
    expect(page.locator(".msg.user")).to_have_count(0)
    expect(box).to_have_value("Hi")
    assert [m["role"] for m in _stored(page)] == ["error"]

    # A 429 that comes while the user already types the next message: the new text is kept.
    pending = []
    page.route("**/v1/chat/completions", lambda route: pending.append(route))
    page.get_by_label("top_p").fill("1")
    page.get_by_role("button", name="Send").click()
    wait_for(lambda: page.evaluate("true") and len(pending) == 1, "the request to reach the route")
    box.fill("Hello")
    body = {
        "error": {"message": "Rate limit reached", "type": "requests", "param": None, "code": "rate_limit_exceeded"}
    }
    pending[0].fulfill(status=429, headers={"content-type": "application/json"}, body=json.dumps(body))
    expect(page.locator(".msg.error").last).to_contain_text("Too many requests (429)")
    expect(page.locator(".msg.user")).to_have_count(0)
    expect(box).to_have_value("Hello")
    page.unroute("**/v1/chat/completions")

    # The next request carries the new message alone, never the ones that failed.
    page.get_by_label("max_tokens").fill("2")
    page.get_by_role("button", name="Send").click()
    expect(page.locator(".msg.assistant .stats")).to_contain_text("tokens", timeout=TIMEOUT_MS)
    assert sent[-1] == [{"role": "user", "content": "Hello"}]
    assert [m["role"] for m in _stored(page)] == ["error", "error", "user", "assistant"]
    expect(page.locator(".msg.user")).to_have_text("Hello")


def test_a_reload_while_a_reply_streams_keeps_the_message_and_the_reply_so_far(page: Page, server: ServerProcess):
    open_chat(page, server)
    set_max_tokens(page, 2000)
    page.get_by_label("Message").fill("Tell me a long story about a lighthouse keeper.")
    page.get_by_role("button", name="Send").click()
    wait_for(lambda: len(reply_text(page).strip()) > 30, "some of the reply")
    assert page.get_by_role("button", name="Stop").is_enabled(), "the reply ended before the reload"
    shown = reply_text(page)

    page.reload()
    expect(page.locator(".msg.user")).to_have_text("Tell me a long story about a lighthouse keeper.")
    # Back as a reply that was stopped, with (at least) the text that was shown.
    expect(page.locator(".msg.assistant .stats")).to_contain_text("stopped")
    assert reply_text(page)[:30] == shown[:30]
    expect(page.get_by_label("Message")).to_have_value("")
    wait_for(lambda: metric(server.url, "servelm:num_requests_running") == 0, "the server to free the request")

    # What a page that went without a word (a crash, a killed tab) saved while streaming:
    # the reply so far comes back stopped; a message with no reply text yet, back in the composer.
    def saved_mid_stream(reply: str) -> None:
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply, "streaming": True}]
        page.evaluate("(c) => localStorage.setItem('servelm.chat', JSON.stringify(c))", {"messages": messages})
        page.reload()

    saved_mid_stream("Once upon")
    expect(page.locator(".msg.assistant .stats")).to_have_text("stopped")
    expect(page.locator(".msg.assistant .content")).to_have_text("Once upon")
    saved_mid_stream("")
    expect(page.get_by_label("Message")).to_have_value("Hi")
    expect(page.locator(".msg")).to_have_count(0)


def test_an_error_mid_stream_keeps_the_reply_so_far_and_names_the_error(page: Page, server: ServerProcess):
    open_chat(page, server)

    def chunk(delta: dict) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        return "data: " + json.dumps({"object": "chat.completion.chunk", "choices": [choice]}) + "\n\n"

    message = "The request did not finish within the server's request timeout (1 s) and was aborted."
    error = {"error": {"message": message, "type": "timeout_error", "param": None, "code": "request_timeout"}}
    body = chunk({"role": "assistant", "content": ""}) + chunk({"content": "The first half"})
    body += "data: " + json.dumps(error) + "\n\ndata: [DONE]\n\n"
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=body),
    )
    page.get_by_label("Message").fill("Hi")
    page.get_by_role("button", name="Send").click()
    # The text shown stays, with the error by its own status (a timeout is a 408, not a 500).
    expect(page.locator(".msg.assistant .stats")).to_have_text(
        re.compile(r"^TTFT \d+ ms · ~1 tokens · cut short by Error 408: " + re.escape(message) + "$")
    )
    expect(page.locator(".msg.assistant .content")).to_have_text("The first half")
    expect(page.locator(".msg.user")).to_have_text("Hi")
    expect(page.locator(".msg.error")).to_have_count(0)
    assert _stored(page)[-1]["content"] == "The first half"


def test_a_reader_who_scrolled_up_is_not_pulled_back_down(page: Page, server: ServerProcess):
    page.goto(server.url + "/")
    long_reply = "\n\n".join(f"Paragraph {i}." for i in range(120))  # taller than the window
    conversation = {"messages": [{"role": "user", "content": "Count."}, {"role": "assistant", "content": long_reply}]}
    page.evaluate("(c) => localStorage.setItem('servelm.chat', JSON.stringify(c))", conversation)
    open_chat(page, server)
    set_max_tokens(page, 300)
    page.get_by_label("Message").fill("Tell me a long story about a lighthouse keeper.")
    page.get_by_role("button", name="Send").click()
    log = page.locator("#log")
    at_bottom = "(el) => el.scrollHeight - el.scrollTop - el.clientHeight < 40"
    wait_for(lambda: len(reply_text(page).strip()) > 0, "the first tokens of the reply")
    assert log.evaluate(at_bottom), "a reader at the end follows the reply"

    log.evaluate("(el) => { el.scrollTop = 0; }")  # the reader scrolls up
    shown = reply_text(page)
    wait_for(lambda: len(reply_text(page)) > len(shown) + 20, "the reply to grow")
    assert log.evaluate("(el) => el.scrollTop") == 0
    page.get_by_role("button", name="Stop").click()
    expect(page.locator(".msg.assistant .stats").last).to_contain_text("stopped")
    assert log.evaluate("(el) => el.scrollTop") == 0


def test_full_storage_shows_a_note_and_the_chat_goes_on(page: Page, server: ServerProcess):
    page.add_init_script("""(() => {
      const setItem = Storage.prototype.setItem;
      Storage.prototype.setItem = function (key, value) {
        if (key === 'servelm.chat') throw new DOMException('The quota has been exceeded.', 'QuotaExceededError');
        return setItem.call(this, key, value);
      };
    })()""")
    open_chat(page, server)
    set_max_tokens(page, 3, temperature=0)
    page.get_by_label("Message").fill("Hi")
    page.get_by_role("button", name="Send").click()
    expect(page.locator(".msg.assistant .stats")).to_contain_text("3 tokens", timeout=TIMEOUT_MS)
    expect(page.locator("#note")).to_have_text(
        "This conversation could not be saved in the browser (QuotaExceededError); a reload will lose it."
    )
    expect(page.locator(".msg.user")).to_have_text("Hi")
    expect(page.get_by_role("button", name="Send")).to_be_enabled()
    assert not page.errors  # type: ignore[attr-defined]


def test_a_429_says_how_long_to_wait_once(page: Page, server: ServerProcess):
    open_chat(page, server)
    replies = [
        # The rate limiter names the wait in its message...
        (
            "Rate limit reached on requests per min (RPM): Limit 1, Used 1, Requested 1. Please try again in 46.648s.",
            "47",
        ),
        # ...admission control points at the header, which the page reads out.
        (
            "The server is at capacity: 4 requests are already waiting. Retry after the time in the Retry-After header.",
            "1",
        ),
    ]

    def reply(route) -> None:
        message, retry_after = replies.pop(0)
        body = {"error": {"message": message, "type": "requests", "param": None, "code": "rate_limit_exceeded"}}
        route.fulfill(
            status=429, headers={"retry-after": retry_after, "content-type": "application/json"}, body=json.dumps(body)
        )

    page.route("**/v1/chat/completions", reply)
    page.get_by_label("Message").fill("Hi")
    page.get_by_role("button", name="Send").click()
    expect(page.locator(".msg.error")).to_have_text(
        "Too many requests (429): Rate limit reached on requests per min (RPM): Limit 1, Used 1, Requested 1. "
        "Please try again in 46.648s."
    )
    page.get_by_role("button", name="Send").click()  # the message is back in the composer
    expect(page.locator(".msg.error").last).to_have_text(
        "Too many requests (429): The server is at capacity: 4 requests are already waiting. Retry after 1 s."
    )
