"""The web pages' routes: served with a strict CSP, public under auth, off with --no-web."""

from __future__ import annotations

from servelm.engine.outputs import EngineStats

from .conftest import make_app, make_client
from .fake_connector import CHAT_MODEL, FakeConnector
from .test_metrics import parse, value


async def test_pages_are_served_with_a_strict_content_security_policy(client):
    for path, marker in (("/", 'id="message"'), ("/status", 'id="chart-tokens"')):
        r = await client.get(path)
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/html")
        assert marker in r.text
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "connect-src 'self'" in csp
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert r.headers["x-frame-options"] == "DENY"


async def test_the_pages_scripts_and_vendored_libraries_are_served(client):
    page = (await client.get("/")).text
    assert '<script type="module" src="/static/js/chat.js"></script>' in page
    for path in (
        "/static/js/chat.js",
        "/static/js/status.js",
        "/static/vendor/marked.esm.js",
        "/static/vendor/purify.es.mjs",
        "/static/vendor/highlight.min.js",
        "/static/vendor/uPlot.esm.js",
    ):
        r = await client.get(path)
        assert r.status_code == 200, path
        assert "javascript" in r.headers["content-type"], path  # module scripts need a JS MIME type
        assert "content-security-policy" in r.headers
    assert (await client.get("/static/missing.js")).status_code == 404


async def test_pages_are_public_but_the_api_still_needs_the_key(fake):
    async with make_client(make_app(fake, api_keys=["sk-web"])) as c:
        assert (await c.get("/")).status_code == 200
        assert (await c.get("/status")).status_code == 200
        assert (await c.get("/static/js/api.js")).status_code == 200
        r = await c.get("/v1/models")
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer sk-web"})).status_code == 200
        # A path that merely starts like a page is not public.
        assert (await c.get("/statusx")).status_code == 401


async def test_no_web_serves_no_pages(fake):
    async with make_client(make_app(fake, web=False)) as c:
        assert (await c.get("/")).status_code == 404
        assert (await c.get("/status")).status_code == 404
        assert (await c.get("/static/js/chat.js")).status_code == 404
        assert (await c.get("/v1/models")).status_code == 200


async def test_metrics_describe_the_model_kv_cache_and_uptime():
    class Described(FakeConnector):
        async def engine_stats(self):
            return [
                EngineStats(CHAT_MODEL, dtype="bfloat16", device="cpu", kv_cache_tokens=4096, kv_cache_bytes=96 << 20)
            ]

    async with make_client(make_app(Described())) as c:
        m = parse((await c.get("/metrics")).text)
    assert value(m, "servelm:model_info", model_name=CHAT_MODEL, dtype="bfloat16", device="cpu") == 1
    assert value(m, "servelm:kv_cache_size_tokens", model_name=CHAT_MODEL) == 4096
    assert value(m, "servelm:kv_cache_size_bytes", model_name=CHAT_MODEL) == 96 << 20
    assert value(m, "servelm:uptime_seconds") >= 0
