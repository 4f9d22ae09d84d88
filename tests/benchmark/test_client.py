"""One streamed request: SSE parsing, timing and every way it can fail, against handlers served on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from servelm.benchmark.client import BenchClient, SamplingOptions, request_body, send_request
from servelm.benchmark.dataset import BenchRequest
from servelm.clients import async_sse_lines, sse_lines

REQ = BenchRequest(prompt=[5, 6, 7], prompt_len=3, output_len=4)


def sse(*events: object, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events]
    if done:
        lines.append("data: [DONE]\n\n")
    return "".join(lines).encode()


def text_chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}], "usage": None}


def chat_chunk(content: str | None, role: str | None = None) -> dict:
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}], "usage": None}


USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}


async def send(handler, endpoint: str = "completions", timeout: float | None = 5.0, req: BenchRequest = REQ):
    """send_request to a server on 127.0.0.1 whose every path answers with ``handler``."""
    app = web.Application()
    app.router.add_route("*", "/{path:.*}", handler)
    async with TestServer(app, host="127.0.0.1") as server:
        async with BenchClient(str(server.make_url("/")), timeout=timeout) as client:
            return await send_request(client, endpoint, "m", req, SamplingOptions(), timeout)


def answer(response_factory):
    """A handler answering every request with a fresh response from ``response_factory``."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return response_factory()

    return handler


def test_request_body_for_each_endpoint():
    body = request_body("completions", "m", REQ, SamplingOptions())
    assert body == {
        "model": "m",
        "prompt": [5, 6, 7],
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chat = request_body(
        "chat",
        "m",
        BenchRequest("hi", None, 9),
        SamplingOptions(ignore_eos=False, send_min_tokens=True, temperature=0.0),
    )
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert chat["max_tokens"] == 9 and chat["min_tokens"] == 9 and chat["temperature"] == 0.0
    assert "ignore_eos" not in chat and "prompt" not in chat
    extra = {"response_format": {"type": "json_object"}, "max_tokens": 2, "stream": False}
    body = request_body("chat", "m", BenchRequest("hi", None, 9), SamplingOptions(extra_body=extra))
    assert body["response_format"] == {"type": "json_object"} and body["max_tokens"] == 2
    assert body["stream"] is True  # the benchmark reads a stream, whatever the extra body says


async def test_completion_stream_with_usage_counts_tokens_from_usage():
    seen = {}

    async def handler(request: web.Request) -> web.Response:
        seen["path"] = request.path
        seen["body"] = await request.json()
        # two tokens in one chunk: usage, not the chunk count, gives the output length
        return web.Response(body=sse(text_chunk("ab"), text_chunk("c"), text_chunk("d"), USAGE))

    r = await send(handler)
    assert seen["path"] == "/v1/completions" and seen["body"]["max_tokens"] == 4
    assert r.error is None
    assert (r.prompt_tokens, r.output_tokens, r.output_len) == (3, 4, 4)
    assert r.ttft is not None and 0 <= r.ttft <= r.e2e
    assert len(r.itl) == 2  # gaps between the three content chunks


async def test_chat_stream_skips_the_role_chunk():
    async def handler(request: web.Request) -> web.Response:
        if request.path != "/v1/chat/completions":
            return web.Response(status=404)
        return web.Response(body=sse(chat_chunk(None, role="assistant"), chat_chunk("x"), chat_chunk("y"), USAGE))

    r = await send(handler, endpoint="chat", req=BenchRequest("hello", None, 4))
    assert r.error is None and r.output_tokens == 4 and len(r.itl) == 1
    assert r.prompt_tokens == 3  # from usage, as the prompt length was unknown


async def test_without_usage_content_chunks_are_counted():
    r = await send(answer(lambda: web.Response(body=sse(text_chunk("a"), text_chunk("b"), text_chunk("")))))
    assert r.error is None and r.output_tokens == 2 and r.prompt_tokens == 3  # our own prompt length


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (
            lambda: web.json_response(
                {"error": {"message": "Rate limit reached", "type": "rate_limit_error"}}, status=429
            ),
            "HTTP 429: Rate limit reached",
        ),
        (lambda: web.Response(status=502, text="<html>bad gateway</html>"), "HTTP 502: <html>bad gateway</html>"),
        (
            lambda: web.Response(body=sse(text_chunk("a"), {"error": {"message": "engine failed"}})),
            "stream error: engine failed",
        ),
        (
            lambda: web.Response(body=sse(text_chunk("a"), text_chunk("b"), done=False)),
            "stream ended without [DONE]",
        ),
        (lambda: web.Response(body=sse(USAGE)), "no content in the stream"),
        (lambda: web.Response(body=b"data: {not json\n\n"), "bad response: JSONDecodeError"),
    ],
)
async def test_failures_become_results(response, expected):
    r = await send(answer(response))
    assert r.error is not None and r.error.startswith(expected), r.error


async def test_connection_error_becomes_a_result():
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with BenchClient(f"http://127.0.0.1:{port}") as client:
        r = await send_request(client, "completions", "m", REQ, SamplingOptions(), 5.0)
    assert r.error is not None
    assert r.error.startswith("connection error: ClientConnectorError: Cannot connect to host 127.0.0.1"), r.error


async def test_a_slow_request_times_out():
    async def handler(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response(body=sse(text_chunk("a")))

    r = await send(handler, timeout=0.05)
    assert r.error == "timeout after 0.05s"
    assert 0.04 <= r.e2e < 2


async def test_long_error_messages_are_shortened():
    r = await send(answer(lambda: web.json_response({"error": {"message": "x" * 1000}}, status=400)))
    assert r.error is not None and len(r.error) <= 200 and r.error.endswith("...")


async def test_text_with_unicode_line_separators_is_not_cut():
    # Only CR and LF end an SSE line; a server may send U+2028 raw inside a JSON string.
    async def handler(request: web.Request) -> web.Response:
        events = [text_chunk("a\u2028b"), text_chunk("c\x85d\u2029"), USAGE]
        body = "".join(f"data: {json.dumps(e, ensure_ascii=False)}\r\n\r\n" for e in events) + "data: [DONE]\n\n"
        return web.Response(body=body.encode())

    r = await send(handler)
    assert r.error is None
    assert r.output_tokens == 4 and len(r.itl) == 1


async def test_async_sse_lines_end_at_cr_and_lf_alone_wherever_the_bytes_break():
    # The benchmark's reader: bytes as they arrive, split inside a CRLF and inside a character's UTF-8.
    body = 'data: {"t":"a\u2028b\x85\u00e9"}\r\n\r\ndata: {"t":"c"}\n\ndata: [DONE]'.encode()
    cut_crlf, cut_char = body.index(b"\r") + 1, body.index("\u00e9".encode()) + 1

    async def parts():
        for start, end in [(0, cut_char), (cut_char, cut_crlf), (cut_crlf, len(body) - 3), (len(body) - 3, None)]:
            yield body[start:end]

    lines = [line async for line in async_sse_lines(parts()) if line]
    assert lines == ['data: {"t":"a\u2028b\x85\u00e9"}', 'data: {"t":"c"}', "data: [DONE]"]


def test_sse_lines_end_at_cr_and_lf_alone_wherever_the_chunks_break():
    # What `servelm chat` reads its stream with.
    body = ['data: {"t":"a\u2028b\x85"}\r', '\n\r\ndata: {"t":"c"}\n', "\ndata: [DO", "NE]"]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=iter(part.encode() for part in body))

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        with client.stream("GET", "http://t/") as response:
            lines = [line for line in sse_lines(response) if line]
    assert lines == ['data: {"t":"a\u2028b\x85"}', 'data: {"t":"c"}', "data: [DONE]"]
