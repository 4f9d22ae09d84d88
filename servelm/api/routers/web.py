"""The browser pages: the chat page at ``/``, the live status page at ``/status``, their files under ``/static``.

The pages are plain HTML and ES modules (servelm/web/static), with vendored
libraries, so nothing is built or fetched at run time. They are public: the
API calls the page makes carry the key the user typed, when auth is on.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles
from starlette.types import Message, Receive, Scope, Send

from servelm.web import STATIC_DIR

# No inline script or style, nothing from another origin: a reply that slipped
# past the sanitizer still could not run code or send data anywhere.
CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # The page keeps the API key in localStorage: never let it be framed.
    "X-Frame-Options": "DENY",
}
# Paths the auth middleware lets through without a key: the pages and their files.
PUBLIC_PATHS = frozenset({"/", "/status"})
PUBLIC_PREFIX = "/static/"

router = APIRouter(tags=["web"], include_in_schema=False)


def _page(name: str) -> Response:
    # no-cache: a server upgrade shows the new page at the next load.
    return FileResponse(STATIC_DIR / name, headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"})


@router.get("/")
async def chat_page() -> Response:
    """The chat page."""
    return _page("index.html")


@router.get("/status")
async def status_page() -> Response:
    """The live status page (charts of /metrics)."""
    return _page("status.html")


class SecureStaticFiles(StaticFiles):
    """The pages' scripts, styles and vendored libraries, with the same security headers."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [(k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
                headers.append((b"cache-control", b"no-cache"))
                message = {**message, "headers": headers}
            await send(message)

        await super().__call__(scope, receive, with_headers)


def static_files() -> SecureStaticFiles:
    return SecureStaticFiles(directory=STATIC_DIR)
