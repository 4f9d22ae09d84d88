"""The local connector's behaviour that needs no loaded model."""

from __future__ import annotations

import pytest

from servelm.connectors.base import Connector, ModelNotFound
from servelm.connectors.local import LocalConnector
from servelm.engine.sampling_params import SamplingParams


async def test_not_healthy_before_load_and_lists_nothing():
    conn = LocalConnector("smollm2-135m-instruct", "all-minilm-l6-v2")
    assert isinstance(conn, Connector)
    assert await conn.health() is False
    assert await conn.models() == []


async def test_unknown_model_is_model_not_found():
    conn = LocalConnector("smollm2-135m-instruct", None)
    with pytest.raises(ModelNotFound) as err:
        async for _ in conn.generate("gpt-4", "r1", "hi", SamplingParams()):
            pass
    assert err.value.status == 404 and err.value.code == "model_not_found"
    with pytest.raises(ModelNotFound):
        await conn.embed("all-minilm-l6-v2", ["hi"])
    with pytest.raises(ModelNotFound):
        await conn.tokenize("nope", "hi")
