"""Property-based fuzzing of every operation in /openapi.json: no input yields a 5xx."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings

from servelm.api import create_app
from servelm.settings import Settings

from .fake_connector import FakeConnector

# Built at import (schemathesis parametrizes at collection). model_construct
# takes the defaults without reading SERVELM_* from the developer's shell. A
# short context and reply keep generated requests (n up to 128, max_tokens up
# to the context) cheap.
_app = create_app(FakeConnector(reply_text="ok", max_model_len=48), Settings.model_construct())
schema = schemathesis.openapi.from_asgi("/openapi.json", _app)


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
