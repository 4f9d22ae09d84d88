"""StructuredOutputsParams without a model or xgrammar: one kind, checked types, refused schema keywords."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelm.engine.sampling_params import SamplingParams, SamplingParamsError
from servelm.engine.structured_outputs import StructuredOutputsError, StructuredOutputsParams, unenforced_keyword

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["b"]}


@pytest.mark.parametrize(
    "spec, kind",
    [
        ({"json": SCHEMA}, "json"),
        ({"json": json.dumps(SCHEMA)}, "json"),
        ({"json_object": True}, "json_object"),
        ({"regex": "[a-z]+"}, "regex"),
        ({"choice": ["a", "b"]}, "choice"),
        ({"grammar": 'root ::= "x"'}, "grammar"),
        ({"structural_tag": "{}"}, "structural_tag"),
    ],
)
def test_each_kind(spec, kind):
    params = StructuredOutputsParams(**spec)
    assert params.kind == kind
    assert pickle.loads(pickle.dumps(params)) == params  # it travels to Ray replicas as it is
    assert SamplingParams(structured_outputs=params).structured_outputs is params


@pytest.mark.parametrize(
    "spec", [{}, {"regex": "a", "choice": ["a"]}, {"json": SCHEMA, "json_object": True}, {"json_object": False}]
)
def test_exactly_one_kind(spec):
    with pytest.raises(StructuredOutputsError) as info:
        StructuredOutputsParams(**spec)
    assert info.value.param == "structured_outputs" and "exactly one" in str(info.value)


@pytest.mark.parametrize(
    "spec, param",
    [
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"json": "[1, 2]"}, "structured_outputs.json"),
        ({"json": 5}, "structured_outputs.json"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"regex": 5}, "structured_outputs.regex"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", ""]}, "structured_outputs.choice"),
        ({"choice": "ab"}, "structured_outputs.choice"),
        ({"grammar": "  "}, "structured_outputs.grammar"),
        ({"json_object": "yes"}, "structured_outputs.json_object"),
    ],
)
def test_bad_values_name_their_field(spec, param):
    with pytest.raises(StructuredOutputsError) as info:
        StructuredOutputsParams(**spec)
    assert info.value.param == param and str(info.value).startswith(param)
    assert isinstance(info.value, SamplingParamsError)  # the edge and the connectors handle it as one


@pytest.mark.parametrize(
    "schema, where",
    [
        ({"not": {"type": "string"}}, "'not' (at schema)"),
        ({"type": "object", "properties": {"a": {"if": {}, "then": {}}}}, "(at schema.properties.a)"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "array", "contains": {"type": "integer"}}, "'contains'"),
        ({"allOf": [{"type": "integer"}, {"minimum": 2}]}, "allOf"),
        (
            {"$defs": {"x": {"anyOf": [{"type": "integer"}, {"dependentRequired": {}}]}}, "$ref": "#/$defs/x"},
            "schema.$defs.x.anyOf[1]",
        ),
        ({"$ref": "https://example.com/schema.json"}, "only references inside the schema"),
    ],
)
def test_keywords_xgrammar_would_not_enforce_are_refused(schema, where):
    with pytest.raises(StructuredOutputsError) as info:
        StructuredOutputsParams(json=schema)
    assert where in str(info.value) and info.value.param == "structured_outputs.json"


@pytest.mark.parametrize(
    "schema",
    [
        SCHEMA,
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": False},
        {"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"type": "integer"}}},
        {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}},  # property names
        {"type": "string", "format": "date-time", "description": "annotations are fine", "title": "T"},
        {"enum": [{"not": 1}]},  # values, not schemas
    ],
)
def test_enforceable_schemas_pass(schema):
    assert unenforced_keyword(schema) is None
    StructuredOutputsParams(json=schema)


def test_the_spec_keeps_property_order():
    a = StructuredOutputsParams(json=SCHEMA)
    b = StructuredOutputsParams(json=dict(reversed(list(SCHEMA.items()))))
    assert list(json.loads(a.spec)["properties"]) == ["b", "a"]  # generation follows this order
    assert a.spec != b.spec
    assert StructuredOutputsParams(json=SCHEMA).spec == a.spec


def test_sampling_params_accepts_only_structured_outputs_params():
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]
    assert info.value.param == "structured_outputs"
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"))
    assert dataclasses.replace(params, max_tokens=3).structured_outputs == params.structured_outputs


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "type",
                    "properties",
                    "items",
                    "not",
                    "allOf",
                    "anyOf",
                    "$ref",
                    "uniqueItems",
                    "x",
                    "$defs",
                    "prefixItems",
                    "additionalProperties",
                ]
            ),
            inner,
            max_size=4,
        )
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(schema=JSON_VALUES)
def test_any_json_value_as_a_schema_is_accepted_or_refused_by_name(schema):
    # Whatever a client sends, construction either succeeds or raises the error the edge turns into a 400.
    try:
        params = StructuredOutputsParams(json=schema if isinstance(schema, (dict, str)) else json.dumps(schema))
    except StructuredOutputsError as exc:
        assert exc.param == "structured_outputs.json"
    else:
        assert params.kind == "json" and isinstance(params.spec, str)
