"""``servelm chat``: an interactive chat in the terminal against a running OpenAI-compatible server."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, TextIO

import httpx

from servelm.clients import envelope_message, server_base_url, sse_lines


def _error_message(response: httpx.Response) -> str:
    message = envelope_message(response.text)
    return message if message is not None else f"HTTP {response.status_code}: {response.text[:200]}"


def run_chat(
    url: str,
    api_key: str | None = None,
    model: str | None = None,
    system: str | None = None,
    temperature: float | None = None,
    max_tokens: int | None = None,
    *,
    input_fn: Callable[[str], str] = input,
    out: TextIO = sys.stdout,
    transport: httpx.BaseTransport | None = None,
) -> int:
    """Interactive chat against a running server; returns the exit status."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = server_base_url(url)
    client = httpx.Client(base_url=base, headers=headers, timeout=httpx.Timeout(30.0, read=None), transport=transport)
    with client:
        try:
            if model is None:
                r = client.get("/v1/models")
                if r.status_code != 200:
                    print(f"error: {_error_message(r)}", file=out)
                    return 1
                models = r.json().get("data", [])
                if not models:
                    print("error: the server serves no models", file=out)
                    return 1
                model = models[0]["id"]
        except httpx.HTTPError as exc:
            print(f"error: cannot reach {base}: {exc}", file=out)
            return 1

        print(f"Chatting with {model} at {base}. /quit or Ctrl-D exits, /reset starts over.", file=out, flush=True)
        start = [{"role": "system", "content": system}] if system else []
        history: list[dict[str, str]] = list(start)
        while True:
            try:
                line = input_fn("you> ")
            except (EOFError, KeyboardInterrupt):
                print(file=out)
                return 0
            text = line.strip()
            if not text:
                continue
            if text in ("/quit", "/exit"):
                return 0
            if text == "/reset":
                history = list(start)
                print("(conversation cleared)", file=out, flush=True)
                continue
            history.append({"role": "user", "content": text})
            body: dict[str, Any] = {"model": model, "messages": history, "stream": True}
            if temperature is not None:
                body["temperature"] = temperature
            if max_tokens is not None:
                body["max_tokens"] = max_tokens
            reply, error = _stream_reply(client, body, out)
            if error is not None:
                print(f"error: {error}", file=out, flush=True)
                history.pop()
                continue
            history.append({"role": "assistant", "content": reply})


def _stream_reply(client: httpx.Client, body: dict[str, Any], out: TextIO) -> tuple[str, str | None]:
    """Stream one reply to ``out``; returns (text, error message or None)."""
    parts: list[str] = []
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return "", _error_message(r)
            for line in sse_lines(r):
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    print(file=out)
                    return "".join(parts), event["error"].get("message", "stream error")
                for choice in event.get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        parts.append(piece)
                        print(piece, end="", file=out, flush=True)
    except KeyboardInterrupt:
        print(" [interrupted]", file=out, flush=True)  # leaving the block closed the stream: the server aborts
        return "".join(parts), None
    except httpx.HTTPError as exc:
        return "", f"request failed: {exc}"
    print(file=out, flush=True)
    return "".join(parts), None
