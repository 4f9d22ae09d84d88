"""Take the README's screenshots (docs/chat.png, docs/status.png) against a real ``servelm serve``.

Run from the repository root: ``.venv/bin/python -m tests.browser.take_screenshots``.
It starts a server on the bundled model, chats once and puts some load on it,
with the same Chromium and flags as the browser tests.
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

from tests.browser.conftest import CHROMIUM, CHROMIUM_ARGS, WAIT_S
from tests.e2e.conftest import CHAT_MODEL, server_process

DOCS = Path(__file__).resolve().parents[2] / "docs"
QUESTION = "Write a Python function that reverses a string, with a short explanation."


def _load(url: str, n: int) -> None:
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 48}
    with httpx.Client(timeout=WAIT_S * 5) as client:  # a loaded machine decodes slowly
        for _ in range(n):
            client.post(url + "/v1/chat/completions", json=body)


def main() -> None:
    with server_process(["--embedding-model", "none"]) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1100, "height": 760})
        page.goto(server.url + "/")
        page.locator("#model option").first.wait_for(state="attached", timeout=WAIT_S * 1000)
        page.get_by_text("Settings").click()
        page.get_by_label("max_tokens").fill("80")
        page.get_by_text("Settings").click()
        page.get_by_label("Message").fill(QUESTION)
        page.get_by_role("button", name="Send").click()
        page.locator(".msg.assistant .stats:not(:empty)").wait_for(timeout=WAIT_S * 4000)
        page.screenshot(path=str(DOCS / "chat.png"))

        page.goto(server.url + "/status")
        threads = [threading.Thread(target=_load, args=(server.url, 3)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        page.wait_for_timeout(2000)  # a screenshot, not a test: let the charts draw the last scrape
        page.screenshot(path=str(DOCS / "status.png"), full_page=True)
        browser.close()
    print(f"wrote {DOCS / 'chat.png'} and {DOCS / 'status.png'}")


if __name__ == "__main__":
    main()
