"""What the client commands (``servelm chat``, ``servelm bench serve``) share: the
server's base URL, the API key they send by default, and reading an error reply."""

from __future__ import annotations

import os
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


def envelope_message(response: httpx.Response) -> Any:
    """The ``error.message`` of a reply in OpenAI's error envelope, or None when the body is not one."""
    try:
        return response.json()["error"]["message"]
    except Exception:
        return None
