"""Structured outputs at the HTTP edge: every way to ask reaches the engine as one spec; every bad ask is a 400 naming its field."""

from __future__ import annotations

import pytest

from servelm.connectors.base import ConnectorError
from servelm.engine.structured_outputs import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT = {"model": "fake-chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5}
COMPLETION = {"model": "fake-chat", "prompt": "x", "max_tokens": 5}
CODE = "invalid_structured_output"


async def post(client, path: str, **fields):
    base = CHAT if "chat" in path else COMPLETION
    return await client.post(path, json={**base, **fields})


def sent(fake) -> StructuredOutputsParams | None:
    return fake.generate_calls[-1][3].structured_outputs


@pytest.mark.parametrize(
    "response_format, expected",
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, StructuredOutputsParams(json_object=True)),
        (
            {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}},
            StructuredOutputsParams(json=SCHEMA),
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "place", "description": "d", "schema": SCHEMA, "strict": None},
            },
            StructuredOutputsParams(json=SCHEMA),
        ),
    ],
)
async def test_response_format_reaches_the_engine(client, fake, response_format, expected):
    r = await post(client, "/v1/chat/completions", response_format=response_format)
    assert r.status_code == 200, r.text
    assert sent(fake) == expected


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("structured_outputs", {"json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
        ("structured_outputs", {"json": '{"type": "integer"}'}, StructuredOutputsParams(json='{"type": "integer"}')),
        ("structured_outputs", {"regex": "[0-9]+"}, StructuredOutputsParams(regex="[0-9]+")),
        ("structured_outputs", {"choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
        ("structured_outputs", {"grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
        ("structured_outputs", {"json_object": True}, StructuredOutputsParams(json_object=True)),
        ("structured_outputs", {"structural_tag": "{}"}, StructuredOutputsParams(structural_tag="{}")),
        (
            "structured_outputs",
            {"regex": "a+", "json_object": False, "choice": None},
            StructuredOutputsParams(regex="a+"),
        ),
        ("guided_json", SCHEMA, StructuredOutputsParams(json=SCHEMA)),
        ("guided_regex", "[0-9]+", StructuredOutputsParams(regex="[0-9]+")),
        ("guided_choice", ["a", "b"], StructuredOutputsParams(choice=["a", "b"])),
        ("guided_grammar", 'root ::= "a"', StructuredOutputsParams(grammar='root ::= "a"')),
    ],
)
async def test_vllm_fields_reach_the_engine(client, fake, path, field, value, expected):
    r = await post(client, path, **{field: value})
    assert r.status_code == 200, r.text
    assert sent(fake) == expected


async def test_no_structured_output_by_default(client, fake):
    assert (await post(client, "/v1/chat/completions")).status_code == 200
    assert sent(fake) is None


def error_of(r, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
        ({"guided_json": SCHEMA, "structured_outputs": {"json": SCHEMA}}, "guided_json"),
        (
            {
                "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
                "structured_outputs": {"json_object": True},
            },
            "structured_outputs.json_object",
        ),
    ],
)
async def test_two_kinds_at_once_is_400(client, fake, fields, param):
    err = error_of(await post(client, "/v1/chat/completions", **fields))
    assert err["param"] == param and err["code"] == CODE and "Only one structured output" in err["message"]
    assert fake.generate_calls == []


@pytest.mark.parametrize(
    "path, fields, param, words",
    [
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"not": {"type": "string"}}},
                }
            },
            "response_format.json_schema.schema",
            "'not'",
        ),
        ("/v1/chat/completions", {"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "uniqueItems"),
        ("/v1/completions", {"structured_outputs": {"json": {"allOf": [{}, {}]}}}, "structured_outputs.json", "allOf"),
        ("/v1/completions", {"structured_outputs": {"json": "{oops"}}, "structured_outputs.json", "not valid JSON"),
        ("/v1/chat/completions", {"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
        ("/v1/chat/completions", {"guided_choice": ["a", ""]}, "guided_choice", "non-empty"),
        ("/v1/completions", {"guided_regex": ""}, "guided_regex", "non-empty"),
        ("/v1/chat/completions", {"structured_outputs": {}}, "structured_outputs", "needs one of"),
        ("/v1/chat/completions", {"structured_outputs": {"json_object": False}}, "structured_outputs", "needs one of"),
    ],
)
async def test_specs_refused_at_the_edge_name_the_field(client, fake, path, fields, param, words):
    err = error_of(await post(client, path, **fields))
    assert err["param"] == param and words in err["message"] and err["code"] == CODE, err
    assert err["message"].startswith(param) or "needs one of" in err["message"]
    assert fake.generate_calls == []


@pytest.mark.parametrize(
    "response_format, param",
    [
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "n"}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "n", "schema": []}}, "response_format.json_schema.schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "extra": 1}},
            "response_format.json_schema.extra",
        ),
        ({"type": "xml"}, "response_format.type"),
        ({}, "response_format.type"),
    ],
)
async def test_malformed_response_format_is_400(client, response_format, param):
    err = error_of(await post(client, "/v1/chat/completions", response_format=response_format))
    assert err["param"] == param, err


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"guided_regex": "(a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "frob"}}}},
            "response_format.json_schema.schema",
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_engine_compile_errors_name_the_client_s_field(client, fake, fields, param, stream):
    # The engine names its own spec; the client sees the field it set, before any stream starts.
    kind = "json" if "response_format" in fields else "regex"
    engine_param = f"structured_outputs.{kind}"
    fake.raise_on_start = ConnectorError(f"{engine_param} does not compile: why", param=engine_param, code=CODE)
    err = error_of(await post(client, "/v1/chat/completions", stream=stream, **fields))
    assert err == {
        "message": f"{param} does not compile: why",
        "type": "invalid_request_error",
        "param": param,
        "code": CODE,
    }


async def test_other_connector_errors_are_left_alone(client, fake):
    fake.raise_on_start = ConnectorError("the prompt is odd", param="prompt")
    err = error_of(await post(client, "/v1/chat/completions", guided_regex="a"))
    assert err["param"] == "prompt" and err["message"] == "the prompt is odd"
