"""Rate limits per client: requests and tokens per minute, with OpenAI's headers and 429s.

A client is its API key when keys are configured, else its address. Each
has two one-minute windows, counted by the ``limits`` library's
fixed-window strategy on a swappable storage (``memory://`` in this
process, ``redis://...`` shared by several replicas): one for requests, one
for tokens. The request is counted by :class:`RateLimitMiddleware` before
the body is read; the handler then reserves the request's prompt tokens
plus ``max_tokens`` (:meth:`RateLimitTicket.reserve_tokens`) and, when the
request ends, corrects the reservation to the tokens actually used
(:meth:`RateLimitTicket.settle`). Fixed windows are used because they are
the strategy whose counters can be corrected exactly, on every storage:
the correction is one ``incr`` by the difference.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

from limits import RateLimitItem, RateLimitItemPerMinute
from limits.aio.storage import MemoryStorage, Storage
from limits.aio.strategies import FixedWindowRateLimiter
from limits.errors import StorageError
from limits.storage import storage_from_string
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servelm.api.errors import APIError, error_response
from servelm.api.metrics import Metrics
from servelm.settings import RateLimit, RateLimits, async_storage_uri

logger = logging.getLogger("servelm.api")

REQUESTS = "requests"
TOKENS = "tokens"
# The endpoints that do model work; cheap ones (models, tokenize, probes) stay unlimited.
LIMITED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
_TICKET = "servelm.rate_limit"  # key in the request's scope["state"]
_ABBREVIATION = {REQUESTS: "RPM", TOKENS: "TPM"}


def format_duration(seconds: float) -> str:
    """A duration as OpenAI's rate-limit headers write it (Go's style): ``1s``, ``6m0s``, ``1.5s``, ``20ms``."""
    ms = max(0, round(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def retry_after(seconds: float) -> int:
    """``Retry-After`` in whole seconds, at least 1, never earlier than the window ends."""
    return max(1, math.ceil(seconds))


class ClockedMemoryStorage(MemoryStorage):
    """``limits``' in-process storage, reading the time from ``clock``.

    ``limits`` reads ``time.time()`` itself; this subclass takes the clock
    as an argument instead, so tests can move time and get exact counts.
    It overrides the operations of the fixed-window strategy (``incr``,
    ``get``, ``get_expiry``) and sweeps expired counters as it writes, so
    memory stays bounded by the clients active within one window. A window
    starts at a key's first increment and lasts ``expiry`` seconds.
    """

    def __init__(self, clock: Callable[[], float] = time.time, sweep_every: float = 60.0):
        super().__init__()
        self.clock = clock
        self.sweep_every = sweep_every
        self._next_sweep = clock() + sweep_every

    def _drop_if_expired(self, key: str, now: float) -> None:
        if key in self.expirations and self.expirations[key] <= now:
            self.storage.pop(key, None)
            self.expirations.pop(key, None)

    def _sweep(self, now: float) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.sweep_every
        for key in [k for k, end in self.expirations.items() if end <= now]:
            self.storage.pop(key, None)
            self.expirations.pop(key, None)

    async def incr(self, key: str, expiry: float, amount: int = 1) -> int:
        """Add ``amount`` (negative to give back) to ``key``'s counter, starting its window if none is open."""
        now = self.clock()
        self._sweep(now)
        self._drop_if_expired(key, now)
        self.storage[key] += amount
        self.expirations.setdefault(key, now + expiry)
        return self.storage[key]

    async def get(self, key: str) -> int:
        """The counter of ``key``'s open window (0 if none)."""
        self._drop_if_expired(key, self.clock())
        return self.storage.get(key, 0)

    async def get_expiry(self, key: str) -> float:
        """When ``key``'s window ends (now if none is open)."""
        now = self.clock()
        self._drop_if_expired(key, now)
        return self.expirations.get(key, now)


class RateLimitExceeded(APIError):
    """429 ``rate_limit_exceeded`` with ``type`` ``requests`` or ``tokens`` and ``Retry-After``."""

    def __init__(self, kind: str, message: str, retry_after_s: int):
        super().__init__(
            message,
            status=429,
            type=kind,
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry_after_s)},
        )
        self.kind = kind


@dataclass(frozen=True)
class Quota:
    """One client's limits as ``limits`` items; ``None`` is unlimited."""

    requests: RateLimitItem | None
    tokens: RateLimitItem | None

    @classmethod
    def of(cls, limit: RateLimit) -> Quota:
        """The items for a configured limit."""

        def item(amount: int | None, kind: str) -> RateLimitItem | None:
            return RateLimitItemPerMinute(amount, namespace=kind) if amount is not None else None

        return cls(item(limit.requests_per_minute, REQUESTS), item(limit.tokens_per_minute, TOKENS))

    @property
    def unlimited(self) -> bool:
        return self.requests is None and self.tokens is None


class RateLimiter:
    """The limits of every client and their counters in one ``limits`` storage.

    ``clock`` must be the clock the storage reads (the wall clock for every
    storage but :class:`ClockedMemoryStorage`): it turns window ends into
    the durations the headers report.
    """

    def __init__(
        self,
        config: RateLimits,
        storage: Storage,
        *,
        clock: Callable[[], float] = time.time,
        metrics: Metrics | None = None,
    ):
        self.config = config
        self.storage = storage
        self.strategy = FixedWindowRateLimiter(storage)
        self.clock = clock
        self.metrics = metrics
        self._default = Quota.of(config.default)
        self._quotas = {identity: Quota.of(config.for_identity(identity)) for identity in config.keys}

    @classmethod
    def from_uri(
        cls, config: RateLimits, uri: str, *, clock: Callable[[], float] = time.time, metrics: Metrics | None = None
    ) -> RateLimiter:
        """A limiter on the storage at ``uri``; ``memory://`` reads ``clock``, a shared store its own time."""
        full = async_storage_uri(uri)
        if full.lower().startswith("async+memory:"):
            return cls(config, ClockedMemoryStorage(clock), clock=clock, metrics=metrics)
        storage = storage_from_string(full, wrap_exceptions=True)
        assert isinstance(storage, Storage)
        return cls(config, storage, clock=time.time, metrics=metrics)

    def quota(self, identity: str) -> Quota:
        """The limits of the client called ``identity`` (an API key or an address)."""
        return self._quotas.get(identity, self._default)

    async def hit(self, item: RateLimitItem, client: str, cost: int) -> bool:
        """Take ``cost`` from ``client``'s window; a refused hit is given back at once."""
        if await self.strategy.hit(item, client, cost=cost):
            return True
        # The fixed window counts refused hits too; undone so that a refused
        # request leaves the counter (and what the headers say) as it was.
        await self.adjust(item, client, -cost)
        return False

    async def adjust(self, item: RateLimitItem, client: str, amount: int) -> None:
        """Add ``amount`` (negative to give back) to ``client``'s open window."""
        await self.storage.incr(item.key_for(client), item.get_expiry(), amount=amount)

    async def give_back(self, item: RateLimitItem, client: str, amount: int, window_end: float | None) -> None:
        """Return ``amount`` taken in the window ending at ``window_end``, if that window is still open.

        A window that has ended took its counter with it; crediting the next
        one would let the client exceed its limit there.
        """
        if window_end is not None and self.clock() < window_end:
            await self.adjust(item, client, -amount)

    async def window_end(self, item: RateLimitItem, client: str) -> float:
        """When ``client``'s open window ends (on the limiter's clock)."""
        return await self.storage.get_expiry(item.key_for(client))

    async def window(self, item: RateLimitItem, client: str) -> tuple[int, float]:
        """``client``'s remaining amount and the seconds until its window ends."""
        stats = await self.strategy.get_window_stats(item, client)
        return max(0, stats.remaining), max(0.0, stats.reset_time - self.clock())

    def rejected(self, kind: str) -> None:
        """Count a 429."""
        if self.metrics is not None:
            self.metrics.rate_limit_rejections.labels(kind).inc()


class RateLimitTicket:
    """One request's dealings with the limiter: its request hit, token reservation and headers."""

    def __init__(self, limiter: RateLimiter, client: str, quota: Quota):
        self.limiter = limiter
        self.client = client  # the storage identifier: never a raw API key
        self.quota = quota
        self.reserved = 0
        self.request_window_end: float | None = None  # end of the window the request was counted in
        self.token_window_end: float | None = None  # end of the window the tokens were reserved in
        self._settled = False

    async def admit(self) -> None:
        """Count the request; raises :class:`RateLimitExceeded` (``requests``) over the limit."""
        item = self.quota.requests
        if item is None:
            return
        if not await self.limiter.hit(item, self.client, 1):
            raise await self._rejection(REQUESTS, item, 1)
        self.request_window_end = await self.limiter.window_end(item, self.client)

    async def reserve_tokens(self, tokens: int) -> None:
        """Reserve ``tokens``; raises :class:`RateLimitExceeded` (``tokens``) when they do not fit."""
        item = self.quota.tokens
        if item is None or tokens <= 0:
            return
        try:
            if not await self.limiter.hit(item, self.client, tokens):
                # A refused request does not count against the requests limit either.
                if self.quota.requests is not None:
                    await self.limiter.give_back(self.quota.requests, self.client, 1, self.request_window_end)
                raise await self._rejection(TOKENS, item, tokens)
            self.reserved = tokens
            self.token_window_end = await self.limiter.window_end(item, self.client)
        except StorageError:
            logger.warning(
                "rate-limit storage failed; admitting %s without a token reservation", self.client, exc_info=True
            )

    async def settle(self, used: int) -> None:
        """Correct the reservation to the ``used`` tokens. Runs once; later calls do nothing.

        Unused tokens go back only while the window they were taken from is
        open (a window that ended took them with it); tokens beyond the
        reservation are charged to the current window.
        """
        if self._settled or self.quota.tokens is None:
            return
        self._settled = True
        try:
            if used > self.reserved:
                await self.limiter.adjust(self.quota.tokens, self.client, used - self.reserved)
            elif used < self.reserved:
                await self.limiter.give_back(
                    self.quota.tokens, self.client, self.reserved - used, self.token_window_end
                )
        except StorageError:
            logger.warning("rate-limit storage failed; could not settle the tokens of %s", self.client, exc_info=True)

    async def headers(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` for the limited dimensions."""
        out: list[tuple[bytes, bytes]] = []
        for kind, item in ((REQUESTS, self.quota.requests), (TOKENS, self.quota.tokens)):
            if item is None:
                continue
            remaining, reset = await self.limiter.window(item, self.client)
            out += [
                (f"x-ratelimit-limit-{kind}".encode(), str(item.amount).encode()),
                (f"x-ratelimit-remaining-{kind}".encode(), str(remaining).encode()),
                (f"x-ratelimit-reset-{kind}".encode(), format_duration(reset).encode()),
            ]
        return out

    async def _rejection(self, kind: str, item: RateLimitItem, requested: int) -> RateLimitExceeded:
        self.limiter.rejected(kind)
        remaining, reset = await self.limiter.window(item, self.client)
        abbreviation = _ABBREVIATION[kind]
        if requested > item.amount:
            # No wait helps: say so rather than send the client into retries.
            message = (
                f"Request too large on {kind} per min ({abbreviation}): Limit {item.amount}, Requested {requested}. "
                f"Reduce the prompt or max_tokens to fit the limit."
            )
        else:
            message = (
                f"Rate limit reached on {kind} per min ({abbreviation}): Limit {item.amount}, "
                f"Used {item.amount - remaining}, Requested {requested}. "
                f"Please try again in {format_duration(reset)}."
            )
        return RateLimitExceeded(kind, message, retry_after(reset))


def rate_limit_ticket(conn: HTTPConnection) -> RateLimitTicket | None:
    """The ticket :class:`RateLimitMiddleware` gave this request (None: not limited)."""
    return cast("RateLimitTicket | None", conn.scope.get("state", {}).get(_TICKET))


def client_identity(scope: Scope, keyed: bool) -> str:
    """Who the request counts against: its bearer token when keys are configured, else its address."""
    if keyed:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                return str(value.decode("latin-1").partition(" ")[2].strip())
        return ""
    client = scope.get("client")
    return client[0] if client else "unknown"


def storage_identifier(identity: str, keyed: bool) -> str:
    """The name a client's counters go under: a digest for keys, so no storage ever holds a secret."""
    if keyed:
        return "key-" + hashlib.sha256(identity.encode()).hexdigest()[:24]
    return "addr-" + identity


class RateLimitMiddleware:
    """Counts each request to a limited endpoint, answers 429 over the limit, adds the headers.

    Runs after authentication (the key is known to be valid) and before the
    body is read. The ticket goes on ``scope["state"]`` for the handler to
    reserve and settle tokens; its headers are computed when the response
    starts, so they include the handler's reservation. If the storage
    fails, requests are let through unlimited and a warning is logged: a
    limiter outage must not become a service outage.
    """

    def __init__(self, app: ASGIApp, limiter: RateLimiter, keyed: bool, paths: Iterable[str] = LIMITED_PATHS):
        self.app = app
        self.limiter = limiter
        self.keyed = keyed
        self.paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        identity = client_identity(scope, self.keyed)
        quota = self.limiter.quota(identity)
        if quota.unlimited:
            await self.app(scope, receive, send)
            return
        ticket = RateLimitTicket(self.limiter, storage_identifier(identity, self.keyed), quota)
        try:
            await ticket.admit()
        except RateLimitExceeded as exc:
            response = error_response(429, exc.message, type=exc.type, code=exc.code, headers=exc.headers)
            response.raw_headers += await self._headers(ticket)
            await response(scope, receive, send)
            return
        except StorageError:
            logger.warning("rate-limit storage failed; admitting a request unlimited", exc_info=True)
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})[_TICKET] = ticket

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *await self._headers(ticket)]}
            await send(message)

        await self.app(scope, receive, send_with_headers)

    async def _headers(self, ticket: RateLimitTicket) -> list[tuple[bytes, bytes]]:
        try:
            return await ticket.headers()
        except StorageError:
            logger.warning("rate-limit storage failed; response sent without rate-limit headers", exc_info=True)
            return []
