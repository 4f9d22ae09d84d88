"""Auth, body size limit, CORS."""

from __future__ import annotations

import pytest

from servelm.api.auth import key_matches

from .conftest import make_app, make_client

CHAT = {"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}


@pytest.fixture
async def authed(fake):
    async with make_client(make_app(fake, api_keys=["k1", "k2"])) as c:
        yield c


async def test_missing_key_401(authed):
    r = await authed.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_api_key", None)


@pytest.mark.parametrize("header", ["Bearer nope", "Bearer k1x", "Basic k1", "k1", "Bearer "])
async def test_wrong_key_401(authed, header):
    r = await authed.post("/v1/chat/completions", json=CHAT, headers={"Authorization": header})
    assert r.status_code == 401
    assert r.json()["error"]["message"] == "Incorrect API key provided."


@pytest.mark.parametrize("key", ["k1", "k2"])
async def test_right_key(authed, key):
    r = await authed.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200


async def test_auth_before_body_parsing(authed):
    r = await authed.post("/v1/chat/completions", content=b"not json")
    assert r.status_code == 401


@pytest.mark.parametrize("path", ["/v1/models", "/tokenize", "/version", "/openapi.json", "/v1/unknown", "/metrics"])
async def test_every_route_needs_the_key(fake, path):
    async with make_client(make_app(fake, api_keys=["k"], metrics_require_auth=True)) as c:
        assert (await c.get(path)).status_code == 401


async def test_probes_stay_open(authed):
    assert (await authed.get("/health")).status_code == 200
    assert (await authed.get("/ping")).status_code == 200
    assert (await authed.get("/ready")).status_code == 200


async def test_metrics_auth_is_configurable(authed, fake):
    assert (await authed.get("/metrics")).status_code == 200  # default: open
    async with make_client(make_app(fake, api_keys=["k"], metrics_require_auth=True)) as c:
        assert (await c.get("/metrics")).status_code == 401
        assert (await c.get("/metrics", headers={"Authorization": "Bearer k"})).status_code == 200


async def test_rejected_requests_are_counted_by_route(authed):
    await authed.post("/v1/chat/completions", json=CHAT)
    text = (await authed.get("/metrics")).text
    assert 'servelm:http_requests_total{method="POST",route="/v1/chat/completions",status="401"} 1.0' in text


def test_key_matches_constant_time_helper():
    keys = [b"alpha", b"beta"]
    assert key_matches("beta", keys)
    assert not key_matches("bet", keys)
    assert not key_matches("", keys)
    assert not key_matches("é", keys)


async def test_body_limit_content_length(fake):
    async with make_client(make_app(fake, max_body_bytes=100)) as c:
        r = await c.post("/v1/completions", json={"model": "fake-chat", "prompt": "x" * 200})
        assert r.status_code == 413
        err = r.json()["error"]
        assert err["code"] == "request_too_large" and "100 bytes" in err["message"]
        ok = await c.post("/v1/completions", json={"model": "fake-chat", "prompt": "x", "max_tokens": 1})
        assert ok.status_code == 200


async def test_body_limit_streamed_body(fake):
    async def body():
        for _ in range(10):
            yield b"x" * 50

    async with make_client(make_app(fake, max_body_bytes=100)) as c:
        r = await c.post("/v1/completions", content=body(), headers={"content-type": "application/json"})
        assert "content-length" not in r.request.headers
        assert r.status_code == 413


async def test_body_limit_streamed_body_under_limit(fake):
    async def body():
        yield b'{"model": "fake-chat", '
        yield b'"prompt": "a", "max_tokens": 1}'

    async with make_client(make_app(fake, max_body_bytes=1000)) as c:
        r = await c.post("/v1/completions", content=body(), headers={"content-type": "application/json"})
        assert r.status_code == 200


async def test_cors_off_by_default(client):
    r = await client.get("/v1/models", headers={"Origin": "http://example.com"})
    assert "access-control-allow-origin" not in r.headers


async def test_cors_when_configured(fake):
    app = make_app(fake, cors_origins=["http://example.com"], api_keys=["k"])
    async with make_client(app) as c:
        pre = await c.options(
            "/v1/chat/completions",
            headers={
                "Origin": "http://example.com",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "http://example.com"
        r = await c.get("/v1/models", headers={"Origin": "http://example.com", "Authorization": "Bearer k"})
        assert r.headers["access-control-allow-origin"] == "http://example.com"
        # Errors carry the CORS headers too, so a browser can read them.
        r = await c.get("/v1/models", headers={"Origin": "http://example.com"})
        assert r.status_code == 401
        assert r.headers["access-control-allow-origin"] == "http://example.com"
        r = await c.get("/v1/models", headers={"Origin": "http://evil.com", "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in r.headers
