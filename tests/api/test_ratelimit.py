"""Rate limits: exact counts under an injected clock, OpenAI's headers and 429s, token reservations."""

from __future__ import annotations

import asyncio
import importlib.util
import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from limits.errors import StorageError
from pydantic import ValidationError

from servelm import cli
from servelm.api import create_app
from servelm.api.ratelimit import (
    ClockedMemoryStorage,
    RateLimiter,
    RateLimitExceeded,
    RateLimitMiddleware,
    RateLimitTicket,
    format_duration,
    retry_after,
)
from servelm.settings import RateLimits, Settings

from .conftest import make_client
from .fake_connector import encode

T0 = 1_700_000_000.0
REPLY_TOKENS = len(encode("Hello world", add_special_tokens=False))  # what the fake generates
CHAT_PROMPT_TOKENS = len(encode("<|user|>x\n<|assistant|>", add_special_tokens=False))  # the fake's template of CHAT


def chat(max_tokens: int = 20, **extra: object) -> dict[str, object]:
    return {"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": max_tokens, **extra}


class Clock:
    """A wall clock that moves only when told."""

    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


def limited_app(fake, clock: Clock, default: dict | None = None, keys: dict | None = None, **settings: object):
    rate_limits = {"default": default or {}, "keys": keys or {}}
    return create_app(fake, Settings(rate_limits=rate_limits, **settings), clock=clock, new_id=lambda: "test")


def limit_headers(r: httpx.Response, kind: str) -> tuple[str, str, str] | None:
    h = r.headers
    if f"x-ratelimit-limit-{kind}" not in h:
        return None
    return h[f"x-ratelimit-limit-{kind}"], h[f"x-ratelimit-remaining-{kind}"], h[f"x-ratelimit-reset-{kind}"]


def rejections(text: str, kind: str) -> float:
    for line in text.splitlines():
        if line.startswith(f'servelm:rate_limit_rejections_total{{kind="{kind}"}}'):
            return float(line.split()[-1])
    return 0.0


# --- requests per minute ----------------------------------------------------


async def test_requests_per_minute_exact_counts(fake, clock):
    async with make_client(limited_app(fake, clock, {"requests_per_minute": 3})) as c:
        statuses = [(await c.post("/v1/chat/completions", json=chat())).status_code for _ in range(10)]
        assert statuses == [200] * 3 + [429] * 7
        metrics = (await c.get("/metrics")).text
        assert rejections(metrics, "requests") == 7
        assert rejections(metrics, "tokens") == 0


async def test_request_headers_count_down_and_the_window_resets(fake, clock):
    async with make_client(limited_app(fake, clock, {"requests_per_minute": 3})) as c:
        seen = []
        for _ in range(3):
            r = await c.post("/v1/chat/completions", json=chat())
            assert r.status_code == 200
            seen.append(limit_headers(r, "requests"))
            clock.advance(1)
        assert seen == [("3", "2", "1m0s"), ("3", "1", "59s"), ("3", "0", "58s")]
        assert limit_headers(r, "tokens") is None  # only limited dimensions are reported

        clock.advance(7)  # 10 s into the window
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 429
        assert r.headers["retry-after"] == "50"
        assert limit_headers(r, "requests") == ("3", "0", "50s")

        clock.advance(49.5)
        r = await c.post("/v1/chat/completions", json=chat())
        assert (r.status_code, r.headers["retry-after"]) == (429, "1")  # never 0, always whole seconds
        assert limit_headers(r, "requests") == ("3", "0", "500ms")

        clock.advance(0.5)  # the window is over: a fresh one starts with this request
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200
        assert limit_headers(r, "requests") == ("3", "2", "1m0s")


async def test_429_envelope(fake, clock):
    async with make_client(limited_app(fake, clock, {"requests_per_minute": 1})) as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        r = await c.post("/v1/chat/completions", json=chat())
    assert r.status_code == 429
    assert r.json() == {
        "error": {
            "message": "Rate limit reached on requests per min (RPM): Limit 1, Used 1, Requested 1. "
            "Please try again in 1m0s.",
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    assert r.headers["retry-after"] == "60"
    assert r.headers["x-request-id"] == "test"


async def test_every_limited_endpoint_counts_and_others_do_not(fake, clock):
    async with make_client(limited_app(fake, clock, {"requests_per_minute": 3})) as c:
        for _ in range(3):
            r = await c.get("/v1/models")
            assert r.status_code == 200 and limit_headers(r, "requests") is None
        assert (await c.post("/tokenize", json={"model": "fake-chat", "prompt": "x"})).status_code == 200
        assert (
            await c.post("/v1/completions", json={"model": "fake-chat", "prompt": "x", "max_tokens": 2})
        ).status_code == 200
        assert (await c.post("/v1/embeddings", json={"model": "fake-embed", "input": "x"})).status_code == 200
        r = await c.post("/v1/chat/completions", json={"messages": "not a list"})
        assert r.status_code == 400  # admitted by the limiter, then invalid: it counted
        assert limit_headers(r, "requests") == ("3", "0", "1m0s")
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 429


async def test_streaming_requests_are_counted(fake, clock):
    async with make_client(limited_app(fake, clock, {"requests_per_minute": 2})) as c:
        for remaining in ("1", "0"):
            async with c.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
                assert r.status_code == 200
                assert limit_headers(r, "requests") == ("2", remaining, "1m0s")
                body = "".join([chunk async for chunk in r.aiter_text()])
            assert body.endswith("data: [DONE]\n\n")
        r = await c.post("/v1/chat/completions", json=chat(stream=True))
        assert r.status_code == 429 and r.json()["error"]["type"] == "requests"
        assert r.headers["content-type"].startswith("application/json")


async def test_limits_off_by_default(fake, clock):
    async with make_client(create_app(fake, Settings(), clock=clock)) as c:
        for _ in range(5):
            r = await c.post("/v1/chat/completions", json=chat())
            assert r.status_code == 200
            assert not [h for h in r.headers if h.startswith("x-ratelimit-")]
        assert "rate_limit_rejections_total{" not in (await c.get("/metrics")).text


# --- tokens per minute -------------------------------------------------------


async def test_tokens_reserved_then_refunded(fake, clock):
    reserve = CHAT_PROMPT_TOKENS + 150
    used = CHAT_PROMPT_TOKENS + REPLY_TOKENS
    tpm = reserve + 30  # room for one reservation of 150 completion tokens at a time
    async with make_client(limited_app(fake, clock, {"tokens_per_minute": tpm})) as c:
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=150))
        assert r.status_code == 200
        assert r.json()["usage"]["total_tokens"] == used
        # A plain response starts after the request ended: its headers show the usage, not the reservation.
        assert limit_headers(r, "tokens") == (str(tpm), str(tpm - used), "1m0s")
        assert limit_headers(r, "requests") is None

        # Without the refund only 30 tokens would be left and this would be refused.
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=100))
        assert r.status_code == 200
        assert limit_headers(r, "tokens")[1] == str(tpm - 2 * used)

        # 150 completion tokens no longer fit what is left: refused for tokens.
        clock.advance(15)
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=150))
        assert r.status_code == 429
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("tokens", "rate_limit_exceeded")
        assert err["message"] == (
            f"Rate limit reached on tokens per min (TPM): Limit {tpm}, Used {2 * used}, Requested {reserve}. "
            "Please try again in 45s."
        )
        assert r.headers["retry-after"] == "45"
        assert limit_headers(r, "tokens") == (str(tpm), str(tpm - 2 * used), "45s")
        assert rejections((await c.get("/metrics")).text, "tokens") == 1


async def held_stream(fake, app, body: dict) -> tuple[asyncio.Task, dict[str, str]]:
    """Start a streamed request the fake holds mid-stream; returns its task and response headers.

    Driven as a server would (httpx's ASGI transport buffers whole responses).
    """
    raw = json.dumps(body).encode()
    messages = [{"type": "http.request", "body": raw, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the client stays
        raise AssertionError("unreachable")

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 5000),
        "server": ("testserver", 80),
    }
    task = asyncio.create_task(app(scope, receive, send))
    await asyncio.wait_for(fake.held.wait(), 5)
    fake.hold_after = None  # hold only this one
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 200
    return task, {k.decode(): v.decode() for k, v in start["headers"]}


async def test_streaming_reserves_until_the_stream_ends(fake, clock):
    fake.hold_after = 2
    used = CHAT_PROMPT_TOKENS + REPLY_TOKENS
    reserve = CHAT_PROMPT_TOKENS + 100
    app = limited_app(fake, clock, {"tokens_per_minute": 1000})
    task, headers = await held_stream(fake, app, chat(max_tokens=100, stream=True))
    # A stream's headers go out at its start: the whole reservation is held.
    assert headers["x-ratelimit-remaining-tokens"] == str(1000 - reserve)
    async with make_client(app) as c:
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=20))  # while the stream runs
        assert limit_headers(r, "tokens")[1] == str(1000 - reserve - used)
        fake.release.set()
        await asyncio.wait_for(task, 5)
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=20))
        assert limit_headers(r, "tokens")[1] == str(1000 - 3 * used)


async def test_a_refund_never_credits_a_later_window(fake, clock):
    fake.hold_after = 2
    used = CHAT_PROMPT_TOKENS + REPLY_TOKENS
    app = limited_app(fake, clock, {"tokens_per_minute": 1000})
    task, _ = await held_stream(fake, app, chat(max_tokens=100, stream=True))
    clock.advance(61)  # the reservation's window ends while the stream runs
    fake.release.set()
    await asyncio.wait_for(task, 5)
    async with make_client(app) as c:
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=20))
        assert limit_headers(r, "tokens") == ("1000", str(1000 - used), "1m0s")


async def test_a_request_refused_for_tokens_does_not_use_a_request(fake, clock):
    async with make_client(limited_app(fake, clock, {"requests_per_minute": 5, "tokens_per_minute": 100})) as c:
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=90))
        assert r.status_code == 429
        assert r.json()["error"]["message"] == (
            f"Request too large on tokens per min (TPM): Limit 100, Requested {CHAT_PROMPT_TOKENS + 90}. "
            "Reduce the prompt or max_tokens to fit the limit."
        )
        assert limit_headers(r, "requests") == ("5", "5", "1m0s")
        assert limit_headers(r, "tokens") == ("100", "100", "1m0s")  # the refused hit opened a window
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=20))
        assert r.status_code == 200
        assert limit_headers(r, "requests")[1] == "4"


async def test_reservation_covers_every_choice_and_prompt(fake, clock):
    async with make_client(limited_app(fake, clock, {"tokens_per_minute": 1000})) as c:
        body = {"model": "fake-chat", "prompt": ["ab", "cde"], "max_tokens": 100, "n": 2, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            # (3 + 100 * 2) + (4 + 100 * 2): BOS plus bytes for each prompt, two choices each.
            assert limit_headers(r, "tokens")[1] == str(1000 - 407)
            await r.aread()


async def test_no_max_tokens_reserves_up_to_the_context(fake, clock):
    async with make_client(limited_app(fake, clock, {"tokens_per_minute": fake.max_model_len - 1})) as c:
        r = await c.post(
            "/v1/chat/completions", json={"model": "fake-chat", "messages": [{"role": "user", "content": "x"}]}
        )
        assert r.status_code == 429
        assert f"Requested {fake.max_model_len}" in r.json()["error"]["message"]


async def test_a_refused_engine_request_is_refunded_in_full(fake, clock):
    fake.raise_on_start = RuntimeError("no")
    async with make_client(limited_app(fake, clock, {"tokens_per_minute": 1000})) as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 500
        fake.raise_on_start = None
        r = await c.post("/v1/chat/completions", json=chat())
        assert limit_headers(r, "tokens")[1] == str(1000 - CHAT_PROMPT_TOKENS - REPLY_TOKENS)


async def test_embeddings_are_charged_their_tokens(fake, clock):
    async with make_client(limited_app(fake, clock, {"tokens_per_minute": 100})) as c:
        r = await c.post("/v1/embeddings", json={"model": "fake-embed", "input": ["abc", "de"]})
        assert r.status_code == 200
        assert r.json()["usage"]["prompt_tokens"] == 7  # BOS + bytes, each
        assert limit_headers(r, "tokens") == ("100", "93", "1m0s")


# --- who is limited ----------------------------------------------------------


async def test_per_key_limits_and_overrides(fake, clock):
    keys = {"k2": {"requests_per_minute": 3}, "k3": {"requests_per_minute": None}}
    app = limited_app(
        fake, clock, {"requests_per_minute": 1, "tokens_per_minute": 500}, keys, api_keys=["k1", "k2", "k3"]
    )

    async def statuses(c: httpx.AsyncClient, key: str, count: int) -> list[int]:
        auth = {"Authorization": f"Bearer {key}"}
        return [(await c.post("/v1/chat/completions", json=chat(), headers=auth)).status_code for _ in range(count)]

    async with make_client(app) as c:
        assert await statuses(c, "k1", 3) == [200, 429, 429]
        assert await statuses(c, "k2", 4) == [200, 200, 200, 429]
        assert await statuses(c, "k3", 5) == [200] * 5  # unlimited requests, tokens inherited
        r = await c.post("/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer k3"})
        assert limit_headers(r, "requests") is None
        assert limit_headers(r, "tokens")[0] == "500"
        # Unauthenticated requests never reach the limiter.
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 401


async def test_per_address_without_keys(fake, clock):
    app = limited_app(fake, clock, {"requests_per_minute": 2}, {"10.0.0.9": {"requests_per_minute": 4}})

    async def statuses(address: str, count: int) -> list[int]:
        transport = httpx.ASGITransport(app=app, client=(address, 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as c:
            return [(await c.post("/v1/chat/completions", json=chat())).status_code for _ in range(count)]

    assert await statuses("10.0.0.1", 3) == [200, 200, 429]
    assert await statuses("10.0.0.2", 3) == [200, 200, 429]
    assert await statuses("10.0.0.1", 1) == [429]
    assert await statuses("10.0.0.9", 5) == [200] * 4 + [429]


async def test_concurrent_requests_never_exceed_the_limit(fake, clock):
    async with make_client(limited_app(fake, clock, {"requests_per_minute": 7})) as c:
        replies = await asyncio.gather(*(c.post("/v1/chat/completions", json=chat()) for _ in range(20)))
    assert sorted(r.status_code for r in replies) == [200] * 7 + [429] * 13
    assert all(r.headers["retry-after"] == "60" for r in replies if r.status_code == 429)


async def test_the_default_wall_clock_path(fake):
    """memory:// with the real clock, as `servelm serve` builds it."""
    app = create_app(fake, Settings(rate_limits={"default": {"requests_per_minute": 2}}))
    async with make_client(app) as c:
        statuses = [(await c.post("/v1/chat/completions", json=chat())).status_code for _ in range(3)]
        assert statuses == [200, 200, 429]
        assert 1 <= int((await c.post("/v1/chat/completions", json=chat())).headers["retry-after"]) <= 60


# --- the limiter against a model of a fixed window ----------------------------

steps = st.lists(
    st.tuples(
        st.floats(0, 40, allow_nan=False),  # seconds since the previous step
        st.integers(1, 120),  # tokens reserved
        st.integers(0, 120),  # tokens used (capped at the reservation)
        st.booleans(),  # settle at once, or only at the end
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(steps)
def test_tokens_follow_a_fixed_window_model(ops):
    """Admissions, refunds and remaining counts equal a plain fixed-window model's, step by step."""
    limit = 100

    async def run() -> None:
        clock = Clock()
        limiter = RateLimiter(
            RateLimits(default={"tokens_per_minute": limit}), ClockedMemoryStorage(clock), clock=clock
        )
        end, count = -1.0, 0  # the model: the open window's end and its count
        open_tickets: list[tuple[RateLimitTicket, int, float]] = []
        for wait, reserve, used, settle_now in ops:
            clock.advance(wait)
            used = min(used, reserve)
            if clock() >= end:  # any hit opens a window, admitted or not
                end, count = clock() + 60, 0
            ticket = RateLimitTicket(limiter, "c", limiter.quota("c"))
            fits = count + reserve <= limit
            try:
                await ticket.reserve_tokens(reserve)
                admitted = True
            except RateLimitExceeded as exc:
                admitted = False
                assert int(exc.headers["Retry-After"]) == retry_after(end - clock())
            assert admitted == fits
            if admitted:
                count += reserve
                open_tickets.append((ticket, used, end))
            if settle_now:
                for t, u, window_end in open_tickets:
                    await t.settle(u)
                    if clock() < window_end:
                        count -= t.reserved - u
                open_tickets.clear()
            remaining, reset = await limiter.window(limiter.quota("c").tokens, "c")
            assert remaining == limit - count
            assert reset == pytest.approx(end - clock())

    asyncio.run(run())


# --- storage -------------------------------------------------------------------


class BrokenStorage(ClockedMemoryStorage):
    """A shared store that is down."""

    async def incr(self, key: str, expiry: float, amount: int = 1) -> int:
        raise StorageError(ConnectionError("redis is down"))

    async def get(self, key: str) -> int:
        raise StorageError(ConnectionError("redis is down"))


async def test_a_failing_storage_lets_requests_through(caplog):
    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    limiter = RateLimiter(RateLimits(default={"requests_per_minute": 1}), BrokenStorage(Clock()), clock=Clock())
    app = RateLimitMiddleware(ok, limiter, keyed=False)
    async with make_client(app) as c:
        for _ in range(3):
            r = await c.post("/v1/chat/completions")
            assert r.status_code == 200 and r.text == "ok"
    assert "rate-limit storage failed" in caplog.text


async def test_clocked_storage_expires_and_sweeps():
    clock = Clock()
    storage = ClockedMemoryStorage(clock, sweep_every=10)
    assert await storage.incr("a", 5, 2) == 2
    assert await storage.get_expiry("a") == T0 + 5
    clock.advance(5)
    assert await storage.get("a") == 0
    assert await storage.get_expiry("a") == T0 + 5  # no window open: "now"
    await storage.incr("b", 1)
    clock.advance(10)
    await storage.incr("c", 1)  # a write past sweep_every drops every expired counter
    assert set(storage.storage) == {"c"}


@pytest.mark.parametrize(
    "seconds,text",
    [
        (0, "0s"),
        (0.0004, "0s"),
        (0.02, "20ms"),
        (0.9996, "1s"),
        (1, "1s"),
        (1.5, "1.5s"),
        (8.64, "8.64s"),
        (60, "1m0s"),
        (360, "6m0s"),
        (61.25, "1m1.25s"),
        (3723, "1h2m3s"),
        (-3, "0s"),
    ],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("seconds,header", [(0, 1), (0.2, 1), (1, 1), (1.01, 2), (59.5, 60)])
def test_retry_after_is_whole_seconds_at_least_one(seconds, header):
    assert retry_after(seconds) == header


# --- settings ------------------------------------------------------------------


def load(argv: list[str]) -> Settings:
    parser = cli.build_parser()
    args = parser.parse_args(cli._normalise_argv(argv))
    return cli.settings_from_args(args, args.command_parser)


def test_flags_set_the_default_and_keep_the_file_overrides(tmp_path):
    config = tmp_path / "servelm.yaml"
    config.write_text(
        "api_keys: [k1]\nrate_limits:\n  default: {tokens_per_minute: 1000}\n  keys: {k1: {requests_per_minute: 9}}\n"
    )
    s = load(["--config", str(config), "--rate-limit-rpm", "5", "--rate-limit-storage", "memory://"])
    assert s.rate_limits.default.model_dump() == {"requests_per_minute": 5, "tokens_per_minute": 1000}
    assert s.rate_limits.for_identity("k1").model_dump() == {"requests_per_minute": 9, "tokens_per_minute": 1000}
    assert load(["--rate-limit-tpm", "7"]).rate_limits.default.tokens_per_minute == 7
    assert not load([]).rate_limits.enabled


def test_a_bad_override_is_named_as_a_config_entry(tmp_path, capsys):
    config = tmp_path / "servelm.yaml"
    config.write_text("rate_limits: {keys: {10.0.0.1: {tokens_per_minute: -5}}}\n")
    with pytest.raises(SystemExit):
        load(["--config", str(config)])
    assert (
        "'rate_limits.keys.10.0.0.1.tokens_per_minute' (config file / SERVELM_RATE_LIMITS)" in capsys.readouterr().err
    )


def test_rate_limits_from_the_environment(monkeypatch):
    monkeypatch.setenv("SERVELM_RATE_LIMITS", json.dumps({"default": {"requests_per_minute": 60}}))
    assert load([]).rate_limits.default.requests_per_minute == 60


@pytest.mark.parametrize(
    "argv,text",
    [
        (["--rate-limit-rpm", "0"], "'rate_limits.default.requests_per_minute' (--rate-limit-rpm"),
        (["--rate-limit-tpm", "many"], "'rate_limits.default.tokens_per_minute' (--rate-limit-tpm"),
        (["--rate-limit-storage", "nowhere"], "rate_limit_storage"),
        (["--rate-limit-storage", "bogus://x"], "unknown storage scheme"),
    ],
)
def test_bad_rate_limit_settings_exit_2(argv, text, capsys):
    with pytest.raises(SystemExit) as exc:
        load(argv)
    assert exc.value.code == 2
    assert text in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("coredis") is not None, reason="the redis client is installed")
def test_a_storage_without_its_client_library_exits_2(capsys):
    with pytest.raises(SystemExit):
        load(["--rate-limit-storage", "redis://localhost:6379"])
    err = capsys.readouterr().err
    assert "rate_limit_storage" in err and "coredis" in err


def test_override_for_an_unknown_key_is_refused():
    with pytest.raises(ValidationError, match=r"not one of api_keys \(ending \.\.\.typo\)"):
        Settings(api_keys=["k1"], rate_limits={"keys": {"k1-typo": {"requests_per_minute": 1}}})
    with pytest.raises(ValidationError, match=r"unrecognised|extra"):
        Settings(rate_limits={"default": {"rpm": 1}})
