"""A replica's stream to the front end, without Ray: chunks, not one object per output.

``EngineReplica.generate`` is what Serve streams back to the front end. Its
engine is replaced by a scripted stream the test feeds, so what is checked
is only the chunking: the first output is sent as soon as it is ready, later
outputs within the flush interval of the last item go together as one item
(the request's end flushes at once), the prompt's token ids travel once, a request's error travels as data, and
closing the stream (the client left) closes the engine's stream (which
aborts the request).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from servelm.connectors.base import ConnectorError
from servelm.connectors.ray_replica import FLUSH_INTERVAL_S, EngineReplica
from servelm.engine.outputs import CompletionOutput, RequestOutput
from servelm.engine.sampling_params import SamplingParams

PROMPT = [1, 2, 3]


def output(i: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        "r",
        None,
        list(PROMPT),
        [CompletionOutput(index=0, text=f"t{i}", token_ids=[i], finish_reason="length" if finished else None)],
        finished=finished,
        delta=True,
        num_generated_tokens=i,
    )


class ScriptedEngine:
    """The replica's connector: ``generate`` streams what the test puts in ``source`` (None ends it)."""

    def __init__(self) -> None:
        self.source: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()
        self.closed = asyncio.Event()

    async def generate(self, model: str, request_id: str, prompt, params) -> AsyncIterator[RequestOutput]:
        try:
            while (item := await self.source.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.closed.set()

    def shutdown(self) -> None:
        """Called when the replica is collected; nothing to stop here."""


def replica_with(engine: ScriptedEngine, flush_interval_s: float = FLUSH_INTERVAL_S) -> EngineReplica:
    replica = EngineReplica.__new__(EngineReplica)  # no model load: only the streaming is under test
    replica.connector = engine  # type: ignore[assignment]
    replica.flush_interval_s = flush_interval_s
    return replica


def request() -> dict:
    return {"model": "m", "request_id": "r", "prompt": PROMPT, "params": SamplingParams(max_tokens=5)}


def ids(item: list[RequestOutput]) -> list[int]:
    return [t for out in item for t in out.outputs[0].token_ids]


async def test_outputs_that_pile_up_go_as_one_item_and_the_prompt_travels_once():
    engine = ScriptedEngine()
    stream = replica_with(engine).generate(request())
    engine.source.put_nowait(output(1))
    first = await anext(stream)
    assert ids(first) == [1] and first[0].prompt_token_ids == PROMPT  # sent at once, not held back

    # Three engine steps while the front end was busy with the first item: one item.
    for i in (2, 3, 4):
        engine.source.put_nowait(output(i))
    second = await anext(stream)
    assert ids(second) == [2, 3, 4]
    assert all(out.prompt_token_ids == [] for out in second)

    engine.source.put_nowait(output(5, finished=True))
    engine.source.put_nowait(None)
    assert [ids(item) async for item in stream] == [[5]]
    assert engine.closed.is_set()


async def test_outputs_within_the_interval_are_held_and_the_end_flushes_them():
    engine = ScriptedEngine()
    stream = replica_with(engine, flush_interval_s=3600.0).generate(request())
    engine.source.put_nowait(output(1))
    assert ids(await anext(stream)) == [1]  # the first output is never held
    pending = asyncio.ensure_future(anext(stream))
    engine.source.put_nowait(output(2))
    engine.source.put_nowait(output(3))
    for _ in range(20):  # let the replica take both outputs in
        await asyncio.sleep(0)
    assert not pending.done()  # held: the interval since the last item has not passed
    engine.source.put_nowait(output(4, finished=True))
    assert ids(await pending) == [2, 3, 4]  # the request's end sends everything held at once
    engine.source.put_nowait(None)
    assert [item async for item in stream] == []


async def test_a_held_output_goes_when_the_interval_passes_without_more():
    engine = ScriptedEngine()
    stream = replica_with(engine, flush_interval_s=0.01).generate(request())
    engine.source.put_nowait(output(1))
    await anext(stream)
    engine.source.put_nowait(output(2))
    assert ids(await anext(stream)) == [2]  # nothing else came: the interval's end sends it alone
    await stream.aclose()


async def test_a_request_error_is_sent_as_data_after_the_outputs_before_it():
    engine = ScriptedEngine()
    stream = replica_with(engine).generate(request())
    engine.source.put_nowait(output(1))
    engine.source.put_nowait(ConnectorError("too long", status=400, code="context_length_exceeded", param="messages"))
    items = [item async for item in stream]
    assert ids(items[0]) == [1]
    assert items[1] == {
        "error": {
            "message": "too long",
            "status": 400,
            "type": "invalid_request_error",
            "code": "context_length_exceeded",
            "param": "messages",
        }
    }
    assert len(items) == 2


async def test_closing_the_stream_closes_the_engines_stream():
    engine = ScriptedEngine()
    stream = replica_with(engine).generate(request())
    engine.source.put_nowait(output(1))
    await anext(stream)
    await stream.aclose()  # what Serve does when the front end cancels (its client left)
    assert engine.closed.is_set()
