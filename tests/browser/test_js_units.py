"""Unit tests of the pages' own JavaScript (SSE parsing, the stop path, errors, the metrics parser).

The ES modules are imported in a real Chromium page, so no Node toolchain is
needed. Their files are served by a small static server on 127.0.0.1; no model runs.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
from playwright.sync_api import Page

from servelm.web import STATIC_DIR


class _Handler(SimpleHTTPRequestHandler):
    # Module scripts load only with a JavaScript MIME type.
    extensions_map: ClassVar[dict[str, str]] = {
        **SimpleHTTPRequestHandler.extensions_map,
        ".js": "text/javascript",
        ".mjs": "text/javascript",
    }

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def static_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=str(STATIC_DIR)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def module_page(page: Page, static_url: str) -> Page:
    page.goto(static_url + "/vendor/")  # any page of the origin (a directory listing), to import the modules from
    return page


SSE_PARSE = """async (chunks) => {
  const { SSEParser } = await import('/js/sse.js');
  const parser = new SSEParser();
  const events = [];
  for (const chunk of chunks) events.push(...parser.push(chunk));
  return events;
}"""

STREAM = """
const encoder = new TextEncoder();
// A fetch() stand-in whose body streams `parts`, then stays open; aborting its
// signal errors the body with AbortError, as a real fetch does.
function fakeFetch(parts, { status = 200, headers = {}, log = [] } = {}) {
  return async (url, init) => {
    log.push({ url, auth: new Headers(init.headers).get('Authorization'), body: JSON.parse(init.body || 'null') });
    if (status !== 200) return new Response(JSON.stringify(parts), { status, headers });
    const body = new ReadableStream({
      start(controller) {
        for (const p of parts) controller.enqueue(encoder.encode(p));
        init.signal?.addEventListener('abort', () => controller.error(new DOMException('aborted', 'AbortError')));
      },
      cancel() { log.push('cancelled'); },
    });
    return new Response(body, { status: 200, headers: { 'Content-Type': 'text/event-stream' } });
  };
}
const delta = (text) => 'data: ' + JSON.stringify({ choices: [{ index: 0, delta: { content: text }, finish_reason: null }] }) + '\\n\\n';
"""


def test_sse_events_split_across_chunks_in_any_place(module_page: Page):
    text = 'data: {"a":1}\n\n: keep-alive\n\ndata: line one\ndata: line two\n\ndata:no-space\r\n\r\ndata: [DONE]\n\n'
    expected = ['{"a":1}', "line one\nline two", "no-space", "[DONE]"]
    assert module_page.evaluate(SSE_PARSE, [text]) == expected
    # One character at a time: every line and every event split mid-way, "\r\n" split between chunks.
    assert module_page.evaluate(SSE_PARSE, list(text)) == expected
    assert module_page.evaluate(SSE_PARSE, ['data: {"a"', ":1}\n", "\ndata: partial"]) == ['{"a":1}']


def test_stream_chat_gathers_deltas_usage_and_finish_reason(module_page: Page):
    result = module_page.evaluate(
        STREAM
        + """async () => {
      const { streamChat } = await import('/js/api.js');
      const log = [];
      const seen = [];
      const usage = 'data: ' + JSON.stringify({ choices: [], usage: { prompt_tokens: 5, completion_tokens: 3, total_tokens: 8 } }) + '\\n\\n';
      const stop = 'data: ' + JSON.stringify({ choices: [{ index: 0, delta: {}, finish_reason: 'length' }] }) + '\\n\\n';
      const whole = delta('Hel') + delta('lo') + delta(' ✓') + stop + usage + 'data: [DONE]\\n\\n';
      // Split mid-event and mid-character (✓ is three bytes in UTF-8).
      const bytes = encoder.encode(whole);
      const parts = [bytes.slice(0, 10), bytes.slice(10, 77), bytes.slice(77)].map((b) => new TextDecoder('latin1').decode(b));
      const fetchFn = async (url, init) => {
        log.push(JSON.parse(init.body));
        const body = new ReadableStream({ start(c) { c.enqueue(bytes.slice(0, 10)); c.enqueue(bytes.slice(10, 77)); c.enqueue(bytes.slice(77)); c.close(); } });
        return new Response(body, { status: 200 });
      };
      const r = await streamChat({ model: 'm', messages: [] }, { fetchFn, onText: (t) => seen.push(t) });
      return { r, seen, sent: log[0] };
    }"""
    )
    r = result["r"]
    assert r["text"] == "Hello ✓"
    assert result["seen"] == ["Hel", "Hello", "Hello ✓"]
    assert r["usage"]["completion_tokens"] == 3
    assert r["finishReason"] == "length"
    assert r["stopped"] is False
    assert r["ttft"] is not None
    assert result["sent"]["stream"] is True
    assert result["sent"]["stream_options"] == {"include_usage": True}


def test_stop_aborts_the_request_and_keeps_the_text_so_far(module_page: Page):
    result = module_page.evaluate(
        STREAM
        + """async () => {
      const { streamChat } = await import('/js/api.js');
      const controller = new AbortController();
      const log = [];
      const r = await streamChat({ model: 'm', messages: [] }, {
        signal: controller.signal,
        fetchFn: fakeFetch([delta('partial'), delta(' reply')], { log }),
        onText: (text) => { if (text === 'partial reply') controller.abort(); },
      });
      return { r, signalAborted: controller.signal.aborted };
    }"""
    )
    assert result["r"]["stopped"] is True
    assert result["r"]["text"] == "partial reply"
    assert result["r"]["usage"] is None
    assert result["signalAborted"] is True


def test_http_errors_carry_the_servers_message_and_the_key_is_sent(module_page: Page):
    result = module_page.evaluate(
        STREAM
        + """async () => {
      const { streamChat, setApiKey, ApiError } = await import('/js/api.js');
      setApiKey('sk-test');
      const log = [];
      const body = { error: { message: 'Rate limit reached', type: 'rate_limit_error', param: null, code: 'rate_limit_exceeded' } };
      try {
        await streamChat({ model: 'm', messages: [] }, { fetchFn: fakeFetch(body, { status: 429, headers: { 'retry-after': '7' }, log }) });
        return 'no error';
      } catch (err) {
        return { isApiError: err instanceof ApiError, status: err.status, message: err.message, code: err.code,
                 retryAfter: err.retryAfter, auth: log[0].auth };
      } finally {
        setApiKey('');
      }
    }"""
    )
    assert result == {
        "isApiError": True,
        "status": 429,
        "message": "Rate limit reached",
        "code": "rate_limit_exceeded",
        "retryAfter": "7",
        "auth": "Bearer sk-test",
    }


def test_an_error_event_keeps_the_text_so_far_and_its_own_type_and_code(module_page: Page):
    r = module_page.evaluate(
        STREAM
        + """async () => {
      const { streamChat } = await import('/js/api.js');
      const event = (type, code) =>
        'data: ' + JSON.stringify({ error: { message: 'it failed', type, param: null, code } }) + '\\n\\n';
      const fields = (e) => ({ name: e.name, status: e.status, type: e.type, code: e.code, message: e.message });
      // After some text: the text is returned, with the error.
      const mid = await streamChat({}, { fetchFn: fakeFetch([delta('partial'), event('timeout_error', 'request_timeout')]) });
      // Before any text: thrown.
      const thrown = async (type, code) => {
        try { await streamChat({}, { fetchFn: fakeFetch([event(type, code)]) }); return 'no error'; }
        catch (e) { return fields(e); }
      };
      return { text: mid.text, stopped: mid.stopped, error: fields(mid.error),
               engine: await thrown('server_error', 'engine_error'), unknown: await thrown('odd_error', null) };
    }"""
    )
    assert r["text"] == "partial" and r["stopped"] is False
    # The type's status in docs/API.md (a timeout is a 408), not a made-up 500.
    assert r["error"] == {
        "name": "ApiError",
        "status": 408,
        "type": "timeout_error",
        "code": "request_timeout",
        "message": "it failed",
    }
    assert r["engine"]["status"] == 500 and r["engine"]["code"] == "engine_error"
    assert r["unknown"]["status"] is None and r["unknown"]["type"] == "odd_error"


METRICS_TEXT = r"""# HELP servelm:num_requests_running Sequences running.
# TYPE servelm:num_requests_running gauge
servelm:num_requests_running{model_name="m"} 2.0
servelm:model_info{device="cpu",dtype="float32",model_name="we\"ird\\name"} 1.0
servelm:http_requests_total{method="POST",route="/v1/chat/completions",status="429"} 3.0
servelm:http_requests_total{method="POST",route="/v1/completions",status="429"} 1.0
servelm:http_requests_total{method="POST",route="/v1/completions",status="200"} 9.0
servelm:ttft_seconds_bucket{le="0.1",model_name="m"} 2.0
servelm:ttft_seconds_bucket{le="0.5",model_name="m"} 6.0
servelm:ttft_seconds_bucket{le="+Inf",model_name="m"} 8.0
servelm:uptime_seconds 12.5
"""


def test_metrics_parser_sums_labels_and_computes_quantiles_like_prometheus(module_page: Page):
    r = module_page.evaluate(
        """async (text) => {
      const m = await import('/js/metrics.js');
      const s = m.parsePrometheus(text);
      const b = m.buckets(s, 'servelm:ttft_seconds');
      const earlier = [{ le: 0.1, count: 1 }, { le: 0.5, count: 1 }, { le: Infinity, count: 1 }];
      return {
        running: m.sum(s, 'servelm:num_requests_running'),
        rejected: m.sum(s, 'servelm:http_requests_total', { status: '429' }),
        uptime: m.sum(s, 'servelm:uptime_seconds'),
        missing: m.sum(s, 'servelm:nothing'),
        info: m.labelsOf(s, 'servelm:model_info'),
        p50: m.histogramQuantile(0.5, b),
        p99: m.histogramQuantile(0.99, b),
        none: m.histogramQuantile(0.5, m.bucketDelta(b, b)),
        windowP50: m.histogramQuantile(0.5, m.bucketDelta(b, earlier)),
        // Counts lower than before: the server restarted, and all it saw since is `b` itself.
        afterRestart: m.bucketDelta(b, [{ le: 0.1, count: 9 }, { le: 0.5, count: 9 }, { le: Infinity, count: 9 }]),
      };
    }""",
        METRICS_TEXT,
    )
    assert r["running"] == 2
    assert r["rejected"] == 4
    assert r["uptime"] == 12.5
    assert r["missing"] == 0
    assert r["info"] == {"device": "cpu", "dtype": "float32", "model_name": 'we"ird\\name'}
    # rank 4 of 8 lies in (0.1, 0.5] holding observations 3..6: 0.1 + 0.4 * (4 - 2) / (6 - 2)
    assert r["p50"] == pytest.approx(0.3)
    assert r["p99"] == pytest.approx(0.5)  # in the +Inf bucket: the highest finite bound
    assert r["none"] is None
    # The window holds 7 observations: 1 at or below 0.1, 4 in (0.1, 0.5], 2 above; rank 3.5 -> 0.1 + 0.4 * 2.5 / 4
    assert r["windowP50"] == pytest.approx(0.35)
    assert r["afterRestart"] == [{"le": 0.1, "count": 2}, {"le": 0.5, "count": 6}, {"le": float("inf"), "count": 8}]


def test_rendered_markdown_keeps_code_and_drops_scripts(module_page: Page):
    r = module_page.evaluate("""async () => {
      window.__xss = 0;
      const { renderMarkdown } = await import('/js/render.js');
      const html = renderMarkdown('# Title\\n\\n```python\\nprint(1)\\n```\\n\\n<img src=x onerror="window.__xss++">'
        + '<script>window.__xss++</script>[link](javascript:window.__xss++)');
      const div = document.createElement('div');
      div.innerHTML = html;
      document.body.append(div);
      await new Promise((resolve) => setTimeout(resolve, 200));  // an onerror would have fired by now
      return { html, xss: window.__xss, h1: div.querySelector('h1')?.textContent,
               keyword: div.querySelector('code.language-python .hljs-built_in')?.textContent };
    }""")
    assert r["h1"] == "Title"
    assert r["keyword"] == "print"
    assert r["xss"] == 0
    assert "onerror" not in r["html"] and "<script" not in r["html"] and "javascript:" not in r["html"]
