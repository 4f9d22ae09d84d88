"""Admission control: a bounded waiting queue, a queue timeout and a request timeout.

All against the fake connector, whose queue depth is a knob and whose
streams can be held before their first output or mid-way.
"""

from __future__ import annotations

import json

import pytest

from servelm.settings import Settings

from .conftest import make_app, make_client
from .fake_connector import FakeConnector
from .test_settings_cli import load

CHAT = {"model": "fake-chat", "messages": [{"role": "user", "content": "x"}]}
COMPLETION = {"model": "fake-chat", "prompt": "x"}


def events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


def assert_overloaded(r, code: str) -> None:
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1"
    error = r.json()["error"]
    assert error["type"] == "server_overloaded" and error["code"] == code
    assert "at capacity" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
async def test_a_full_queue_answers_429_before_submitting(path, body, stream):
    fake = FakeConnector(waiting=2)
    async with make_client(make_app(fake, max_waiting=2)) as c:
        r = await c.post(path, json={**body, "stream": stream})
    assert_overloaded(r, "queue_full")
    assert fake.generate_calls == [] and fake.aborted == []


async def test_below_the_limit_is_admitted():
    fake = FakeConnector(waiting=1, running=50)
    async with make_client(make_app(fake, max_waiting=2)) as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "Hello world"


async def test_a_batch_counts_as_its_prompts_times_choices():
    # Every prompt and choice waits as one sequence: 2 waiting + 3 x 2 is past 6.
    fake = FakeConnector(waiting=2)
    async with make_client(make_app(fake, max_waiting=6)) as c:
        r = await c.post("/v1/completions", json={**COMPLETION, "prompt": ["a", "b", "c"], "n": 2})
        assert_overloaded(r, "queue_full")
        assert fake.generate_calls == []
        r = await c.post("/v1/completions", json={**COMPLETION, "prompt": ["a", "b"], "n": 2})
        assert r.status_code == 200, r.text
        assert len(fake.generate_calls) == 2


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {**COMPLETION, "prompt": ["a"] * 5, "n": 2}, "prompt"),
        ("/v1/chat/completions", {**CHAT, "n": 9}, "n"),
    ],
)
async def test_a_run_larger_than_the_whole_queue_is_400(path, body, param):
    # It could never be admitted, so it is the request's error, however empty the queue.
    fake = FakeConnector(waiting=0)
    async with make_client(make_app(fake, max_waiting=8)) as c:
        r = await c.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "more than the server queues at once (8)" in error["message"]
    assert fake.generate_calls == []


async def test_zero_means_unbounded():
    fake = FakeConnector(waiting=10**6)
    async with make_client(make_app(fake, max_waiting=0)) as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_waiting_too_long_is_aborted_with_429(stream):
    fake = FakeConnector(hold_before_first=True)
    async with make_client(make_app(fake, queue_timeout=0.05)) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert_overloaded(r, "queue_timeout")
    (call,) = fake.generate_calls
    assert fake.aborted == [call[1]]


async def test_queue_timeout_aborts_every_prompt_of_a_batch():
    fake = FakeConnector(hold_before_first=True)
    async with make_client(make_app(fake, queue_timeout=0.05)) as c:
        r = await c.post("/v1/completions", json={**COMPLETION, "prompt": ["a", "b"]})
    assert_overloaded(r, "queue_timeout")
    assert sorted(fake.aborted) == sorted(call[1] for call in fake.generate_calls)
    assert len(fake.aborted) == 2


async def test_a_request_running_too_long_gets_408_and_is_aborted():
    fake = FakeConnector(hold_after=1)
    async with make_client(make_app(fake, request_timeout=0.1)) as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 408, r.text
    error = r.json()["error"]
    assert error["type"] == "timeout_error" and error["code"] == "request_timeout"
    (call,) = fake.generate_calls
    assert fake.aborted == [call[1]]


async def test_request_timeout_also_bounds_the_wait_to_start():
    fake = FakeConnector(hold_before_first=True)
    async with make_client(make_app(fake, request_timeout=0.05, queue_timeout=60)) as c:
        r = await c.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
    assert len(fake.aborted) == 1


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
async def test_a_stream_running_too_long_ends_with_an_error_event_then_done(path, body):
    fake = FakeConnector(hold_after=2)
    async with make_client(make_app(fake, request_timeout=0.1)) as c:
        r = await c.post(path, json={**body, "stream": True})
    assert r.status_code == 200
    data = events(r.text)
    assert data[-1] == "[DONE]"
    error = json.loads(data[-2])["error"]
    assert error["type"] == "timeout_error" and error["code"] == "request_timeout"
    assert any("choices" in json.loads(d) for d in data[:-2])  # some output came first
    (call,) = fake.generate_calls
    assert fake.aborted == [call[1]]


async def test_a_fast_request_is_untouched_by_the_timeouts():
    fake = FakeConnector()
    async with make_client(make_app(fake, request_timeout=5, queue_timeout=5, max_waiting=1)) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200 and events(r.text)[-1] == "[DONE]"
    assert "error" not in r.text and fake.aborted == []


def test_defaults_and_flags():
    s = Settings()
    assert (s.max_waiting, s.queue_timeout, s.request_timeout) == (256, 60.0, None)
    s = load(["serve", "--max-waiting", "32", "--queue-timeout", "2.5", "--request-timeout", "30"])
    assert (s.max_waiting, s.queue_timeout, s.request_timeout) == (32, 2.5, 30.0)
    s = load(["serve", "--max-waiting", "0", "--queue-timeout", "0", "--request-timeout", "none"])
    assert (s.max_waiting, s.queue_timeout, s.request_timeout) == (None, None, None)


def test_environment_sets_them(monkeypatch):
    monkeypatch.setenv("SERVELM_MAX_WAITING", "8")
    monkeypatch.setenv("SERVELM_REQUEST_TIMEOUT", "12")
    s = Settings()
    assert s.max_waiting == 8 and s.request_timeout == 12.0


def test_negative_values_are_rejected(capsys):
    with pytest.raises(SystemExit) as exc:
        load(["serve", "--queue-timeout", "-1"])
    assert exc.value.code == 2
    assert "queue" in capsys.readouterr().err
