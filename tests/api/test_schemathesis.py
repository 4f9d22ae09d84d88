"""Property-based fuzzing of every operation in /openapi.json: no input yields a 5xx.

Schemathesis keeps lone UTF-16 surrogates out of its strings (they cannot
travel in headers or query strings), but a JSON body can carry one as
``\\ud800`` and a careless client sends them. A body hook therefore puts a
lone surrogate into one of the generated body's strings for part of the
examples: those must be a 400 like any other invalid text.
"""

from __future__ import annotations

import copy
from typing import Any

import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from servelm.api import create_app
from servelm.settings import Settings

from .fake_connector import FakeConnector

# Built at import (schemathesis parametrizes at collection). model_construct
# takes the defaults without reading SERVELM_* from the developer's shell. A
# short context and reply keep generated requests (n up to 128, max_tokens up
# to the context) cheap.
_app = create_app(FakeConnector(reply_text="ok", max_model_len=48), Settings.model_construct())
schema = schemathesis.openapi.from_asgi("/openapi.json", _app)

_SURROGATES = st.sampled_from(["\ud800", "\udfff", "\udc00", "\udbff"])


def _string_paths(value: Any, path: tuple = ()) -> list[tuple]:
    """Paths (keys and indexes) to every string in a JSON value."""
    if isinstance(value, str):
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _string_paths(v, (*path, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _string_paths(v, (*path, i))]
    return []


def _with_surrogate(body: Any, path: tuple, surrogate: str, at: int) -> Any:
    body = copy.deepcopy(body)
    parent = body
    for key in path[:-1]:
        parent = parent[key]
    text = parent[path[-1]]
    cut = at % (len(text) + 1)
    parent[path[-1]] = text[:cut] + surrogate + text[cut:]
    return body


@schema.hook
def flatmap_body(context: Any, body: Any) -> st.SearchStrategy:
    paths = _string_paths(body)
    if not paths:
        return st.just(body)
    spoiled = st.builds(_with_surrogate, st.just(body), st.sampled_from(paths), _SURROGATES, st.integers(0, 64))
    return st.one_of(st.just(body), spoiled)


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case):
    response = case.call()
    assert response.status_code < 500, f"{case.method} {case.path}: {response.status_code} {response.text[:500]}"
    content_type = response.headers.get("content-type", [""])
    content_type = content_type[0] if isinstance(content_type, list) else content_type
    if response.status_code >= 400 and content_type.startswith("application/json"):
        body = response.json()
        assert set(body["error"]) == {"message", "type", "param", "code"}
    if _has_surrogate(case.body):
        assert response.status_code == 400, f"{case.method} {case.path}: a lone surrogate got {response.status_code}"


def _has_surrogate(value: Any) -> bool:
    return any(any(0xD800 <= ord(c) <= 0xDFFF for c in _get(value, p)) for p in _string_paths(value))


def _get(value: Any, path: tuple) -> Any:
    for key in path:
        value = value[key]
    return value
