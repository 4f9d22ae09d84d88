"""One streamed request to an OpenAI-compatible endpoint, timed.

Kept cheap on purpose: on a machine of a few cores the client takes its CPU
from the server it measures. Requests go through aiohttp, as vLLM's own
benchmark client sends them (httpx's streaming took 93 us of CPU a token
against 43 us, at 32 streams on two cores, and the server's measured
throughput was 4-8% lower for it); SSE lines are parsed with the standard
json module, never through pydantic models, and nothing else happens per
chunk.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from servelm.benchmark.dataset import BenchRequest
from servelm.clients import async_sse_lines, envelope_message

ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
_MAX_MESSAGE = 200


@dataclass(frozen=True)
class SamplingOptions:
    """What every request of a run carries besides its prompt and length."""

    ignore_eos: bool = True
    send_min_tokens: bool = False  # min_tokens = max_tokens; vLLM and servelm accept it, OpenAI does not
    temperature: float | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into each body (a response_format, ...)


@dataclass
class RequestResult:
    """The timing and outcome of one request; times in seconds from when it was sent.

    ``ttft`` is the time to the first chunk with content, ``itl`` the gaps
    between successive content chunks and ``e2e`` the time to the end of the
    stream. ``error`` is None for a completed request, else a short message.
    """

    output_len: int  # what was asked for (max_tokens)
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None
    started: float = 0.0  # time.perf_counter() when sent


def request_body(endpoint: str, model: str, req: BenchRequest, options: SamplingOptions) -> dict[str, Any]:
    """The JSON body of ``req``: streamed, with usage, ``max_tokens`` = its output length, plus ``extra_body``."""
    body: dict[str, Any] = {"model": model}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    body["max_tokens"] = req.output_len
    if options.ignore_eos:
        body["ignore_eos"] = True
    if options.send_min_tokens:
        body["min_tokens"] = req.output_len
    if options.temperature is not None:
        body["temperature"] = options.temperature
    body.update(options.extra_body)
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    return body


# The server names each failed request's id in its message; a report groups the same error once.
_REQUEST_ID = re.compile(r" \(request id [^)]*\)")


def _short(message: str) -> str:
    message = _REQUEST_ID.sub("", " ".join(str(message).split()))
    return message if len(message) <= _MAX_MESSAGE else message[: _MAX_MESSAGE - 3] + "..."


def _http_error(status: int, body: str) -> str:
    detail = envelope_message(body)
    return _short(f"HTTP {status}: {detail if detail is not None else body}")


class BenchClient:
    """A run's connection to the server: an aiohttp session of keep-alive connections, and the server's root
    URL (``root`` + ``/v1/...``; a root with a path of its own keeps it). Use it as an async context."""

    def __init__(self, root: str, api_key: str | None = None, connections: int = 100, timeout: float | None = None):
        self.root = root.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._connections = connections
        # As httpx's Timeout(t): each connect and each read waits at most t; send_request bounds the whole.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> BenchClient:
        connector = aiohttp.TCPConnector(limit=self._connections)
        self.session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout, connector=connector)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """``session.request`` on ``root + path`` with a JSON body (an async context of the response)."""
        assert self.session is not None, "BenchClient is used as an async context"
        return self.session.request(method, self.root + path, json=body)

    async def json(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """The JSON of a 200 reply; raises ``aiohttp.ClientResponseError`` for another status."""
        async with self.request(method, path, body) as response:
            response.raise_for_status()
            return await response.json(content_type=None)


async def _stream(client: BenchClient, path: str, body: dict[str, Any], result: RequestResult, chat: bool) -> None:
    """Send and read the stream into ``result``; raises on transport errors."""
    start = time.perf_counter()
    result.started = start
    last = start
    chunks = 0
    usage: dict[str, Any] | None = None
    async with client.request("POST", path, body) as response:
        if response.status != 200:
            result.error = _http_error(response.status, await response.text(errors="replace"))
            result.e2e = time.perf_counter() - start
            return
        done = False
        async for line in async_sse_lines(response.content.iter_any()):
            if not line.startswith("data:"):
                continue  # blank separators, comments, event: lines
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                error = event["error"]
                message = error.get("message", error) if isinstance(error, dict) else error
                result.error = _short(f"stream error: {message}")
                result.e2e = time.perf_counter() - start
                return
            choices = event.get("choices")
            if choices:
                choice = choices[0]
                if chat:
                    delta = choice.get("delta") or {}
                    text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                else:
                    text = choice.get("text")
                if text:
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
            if event.get("usage"):
                usage = event["usage"]
        result.e2e = time.perf_counter() - start
    if not done:
        result.error = "stream ended without [DONE]"
        return
    if usage is not None:
        result.prompt_tokens = int(usage.get("prompt_tokens") or result.prompt_tokens)
        result.output_tokens = int(usage.get("completion_tokens") or 0)
    else:
        result.output_tokens = chunks  # no usage chunk: one token per content chunk, the best guess
    if result.ttft is None:
        result.error = "no content in the stream"


async def send_request(
    client: BenchClient,
    endpoint: str,
    model: str,
    req: BenchRequest,
    options: SamplingOptions,
    timeout: float | None = None,
) -> RequestResult:
    """Stream one request and time it. Never raises for a failed request: ``error`` says why."""
    result = RequestResult(output_len=req.output_len, prompt_tokens=req.prompt_len or 0)
    body = request_body(endpoint, model, req, options)
    try:
        await asyncio.wait_for(_stream(client, ENDPOINT_PATHS[endpoint], body, result, endpoint == "chat"), timeout)
    except TimeoutError:  # aiohttp's own timeouts are TimeoutErrors too
        result.error = f"timeout after {timeout:g}s" if timeout else "timeout"
    except aiohttp.ClientError as exc:
        result.error = _short(f"connection error: {type(exc).__name__}: {exc}")
    except Exception as exc:  # a garbled stream must not end the run
        result.error = _short(f"bad response: {type(exc).__name__}: {exc}")
    if result.error is not None and result.started:
        result.e2e = result.e2e or time.perf_counter() - result.started
    return result
