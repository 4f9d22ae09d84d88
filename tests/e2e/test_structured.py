"""End to end: structured outputs from a real ``servelm serve``, driven by the official openai client.

Sampled at temperature 0.7, where the bundled model left alone rarely
writes valid JSON: what holds here holds because of the grammar.
"""

from __future__ import annotations

import json
import re

import openai
import pytest
from pydantic import BaseModel

from .conftest import CHAT_MODEL, running_server

pytestmark = pytest.mark.model

TIMEOUT = 300.0  # a safety net per request; nothing here waits on a clock


class City(BaseModel):
    name: str
    country: str
    population: int
    coastal: bool


@pytest.fixture(scope="module")
def client():
    with (
        running_server(["--model", CHAT_MODEL, "--embedding-model", "none"]) as url,
        openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT) as c,
    ):
        yield c


def test_parse_with_a_pydantic_model_parses_ten_times_out_of_ten(client):
    parsed = []
    for seed in range(10):
        reply = client.chat.completions.parse(
            model=CHAT_MODEL,
            messages=[{"role": "user", "content": "Describe a city as JSON: name, country, population, coastal."}],
            response_format=City,
            temperature=0.7,
            seed=seed,
            max_completion_tokens=200,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, City), choice.message.content
        parsed.append(choice.message.parsed)
    assert len({p.model_dump_json() for p in parsed}) > 1


def test_json_object_parses(client):
    reply = client.chat.completions.create(
        model=CHAT_MODEL,
        messages=[{"role": "user", "content": "Give me a JSON object describing a cat."}],
        response_format={"type": "json_object"},
        temperature=0.7,
        seed=1,
        n=3,
        max_completion_tokens=200,
    )
    # A small model may write JSON past any token limit (finish_reason "length", as OpenAI's
    # json_object does); every choice that ended on its own is a whole object.
    finished = [c for c in reply.choices if c.finish_reason == "stop"]
    assert finished and all(c.finish_reason == "length" for c in reply.choices if c not in finished)
    for choice in finished:
        assert isinstance(json.loads(choice.message.content), dict)


def test_regex_and_choice_hold(client):
    messages = [{"role": "user", "content": "What is the capital of France, and its postcode?"}]
    regex = r"[A-Z][a-z]{2,9}, \d{5}"  # bounded: the model cannot spell on until max_tokens
    for seed in range(3):
        reply = client.chat.completions.create(
            model=CHAT_MODEL,
            messages=messages,
            temperature=0.7,
            seed=seed,
            max_completion_tokens=30,
            extra_body={"structured_outputs": {"regex": regex}},
        )
        assert re.fullmatch(regex, reply.choices[0].message.content) and reply.choices[0].finish_reason == "stop"
        choices = ["Paris", "Lyon", "Marseille"]
        reply = client.completions.create(
            model=CHAT_MODEL,
            prompt="The capital of France is",
            temperature=0.7,
            seed=seed,
            max_tokens=10,
            extra_body={"structured_outputs": {"choice": choices}},
        )
        assert reply.choices[0].text in choices


def test_a_streamed_schema_output_assembles_to_valid_json(client):
    stream = client.chat.completions.create(
        model=CHAT_MODEL,
        messages=[{"role": "user", "content": "A city as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": City.model_json_schema(), "strict": True},
        },
        temperature=0.7,
        seed=3,
        max_completion_tokens=200,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # it did stream
    assert chunks[-1].choices[0].finish_reason == "stop"
    City.model_validate_json(text)


def test_bad_schema_is_400_naming_the_param(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=CHAT_MODEL, messages=[{"role": "user", "content": "x"}], response_format=bad, max_completion_tokens=5
        )
    error = info.value.body
    assert error["param"] == "response_format.json_schema.schema" and error["code"] == "invalid_structured_output"
    assert "frobnicate" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=CHAT_MODEL, prompt="x", max_tokens=5, extra_body={"guided_regex": "(ab"})
    assert info.value.body["param"] == "guided_regex"


def test_a_grammar_no_text_can_complete_is_400(client):
    # Refused up front when nothing fits at all; when it comes to a dead end as it runs, the request's
    # own 400 (or, streamed, an error event), never the 500 of an engine failure.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=CHAT_MODEL, prompt="x", max_tokens=5, extra_body={"guided_grammar": "root ::= root"}
        )
    assert info.value.body["param"] == "guided_grammar" and "allows no output" in info.value.body["message"]
    dead_end = {"guided_grammar": 'root ::= "x" rest\nrest ::= rest'}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=CHAT_MODEL, prompt="x", max_tokens=5, extra_body=dead_end)
    assert info.value.body["code"] == "invalid_structured_output"
    assert "allows no further token" in info.value.body["message"]
    with pytest.raises(openai.APIError) as info:
        for _ in client.completions.create(
            model=CHAT_MODEL, prompt="x", max_tokens=5, stream=True, extra_body=dead_end
        ):
            pass
    assert "allows no further token" in str(info.value)
