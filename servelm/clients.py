"""What the client commands (``servelm chat``, ``servelm bench serve``) share: the
server's base URL, the API key they send by default, reading an error reply and
splitting a stream into lines."""

from __future__ import annotations

import codecs
import json
import os
import re
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from typing import Any

import httpx

from servelm.settings import ENV_PREFIX


def server_base_url(url: str) -> str:
    """``url`` without a trailing slash or ``/v1``: the root the client adds paths to."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def api_key_from_env() -> str | None:
    """The first key of ``SERVELM_API_KEYS`` (comma-separated), so a client talks to the local server as configured."""
    keys = [k.strip() for k in os.environ.get(f"{ENV_PREFIX}API_KEYS", "").split(",") if k.strip()]
    return keys[0] if keys else None


def envelope_message(body: str | bytes) -> Any:
    """The ``error.message`` of a reply body in OpenAI's error envelope, or None when it is not one."""
    try:
        return json.loads(body)["error"]["message"]
    except Exception:
        return None


# SSE ends a line at CR, LF or CRLF alone. httpx's iter_lines also ends one at U+2028, U+0085 and the like
# (as str.splitlines() does), which a server may send raw inside a JSON string; aiohttp's line reading
# ends one at LF only.
_SSE_LINE_END = re.compile(r"\r\n|\r|\n")


def sse_lines(response: httpx.Response) -> Iterator[str]:
    """The lines of a streamed response, ended where SSE ends them."""
    rest = ""
    for text in response.iter_text():
        *lines, rest = _SSE_LINE_END.split(rest + text)
        yield from lines
    if rest:
        yield rest


async def async_sse_lines(chunks: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """:func:`sse_lines` for a stream's bytes as they arrive (UTF-8, split anywhere)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    rest = ""
    async for chunk in chunks:
        *lines, rest = _SSE_LINE_END.split(rest + decoder.decode(chunk))
        for line in lines:
            yield line
    rest += decoder.decode(b"", final=True)
    if rest:
        yield rest
