"""API-key authentication: ``Authorization: Bearer <key>`` on every route but the open ones."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from servelm.api.errors import error_response

# Probes must work without a key: load balancers and orchestrators poll them.
ALWAYS_OPEN = frozenset({"/health", "/ready", "/ping"})


def key_matches(presented: str, keys: Iterable[bytes]) -> bool:
    """True if ``presented`` equals one of ``keys``, compared in constant time.

    Every key is compared, so the time taken does not reveal which one (if
    any) matched or how long a common prefix was.
    """
    candidate = presented.encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(candidate, key)
    return matched


class AuthMiddleware:
    """Rejects requests without a valid API key with OpenAI's 401 envelope.

    Runs before routing and before the body is read, so an unauthenticated
    client learns nothing about the request it sent.
    """

    def __init__(
        self,
        app: ASGIApp,
        api_keys: Iterable[str],
        metrics_require_auth: bool = False,
        public_paths: Iterable[str] = (),
        public_prefix: str | None = None,
    ):
        self.app = app
        self.keys = tuple(k.encode() for k in api_keys)
        self.open_paths = ALWAYS_OPEN if metrics_require_auth else ALWAYS_OPEN | {"/metrics"}
        # The web pages and their static files: public, so the page can load and ask for the key.
        self.open_paths = self.open_paths | frozenset(public_paths)
        self.public_prefix = public_prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        public = path in self.open_paths or (self.public_prefix is not None and path.startswith(self.public_prefix))
        if scope["type"] != "http" or public or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        header = ""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        scheme, _, token = header.partition(" ")
        if not header:
            message = "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'."
        elif scheme.lower() != "bearer" or not key_matches(token.strip(), self.keys):
            message = "Incorrect API key provided."
        else:
            await self.app(scope, receive, send)
            return
        response = error_response(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
