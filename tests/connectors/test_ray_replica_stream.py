"""Outputs from replica to front end, without Ray: one channel item per engine step, not one per request.

A request runs as ``EngineReplica.generate``, whose own stream says only
where it runs; its outputs go out on the front end's one channel from that
replica (``EngineReplica.channel``), which carries all of that front end's
requests' outputs of an engine step as one item. The engines here are
scripted and Serve's transport is in memory (``serve_fakes.py``); the
replica and front-end code is the code that runs on Ray.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator

from ray.exceptions import RayActorError

from servelm.connectors.base import ConnectorError, ModelCard
from servelm.connectors.ray import RayConnector
from servelm.engine.outputs import CompletionOutput, RequestOutput
from servelm.engine.sampling_params import SamplingParams
from tests.connectors.serve_fakes import Handle, ServeStream, StandInEngine, replica

PROMPT = [1, 2, 3]


def output(rid: str, i: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        rid,
        None,
        list(PROMPT),
        [CompletionOutput(index=0, text=f"t{i}", token_ids=[i], finish_reason="length" if finished else None)],
        finished=finished,
        delta=True,
        num_generated_tokens=i,
    )


class ScriptedEngine(StandInEngine):
    """The replica's connector: request ``rid`` streams what the test puts in ``sources[rid]`` (None ends it)."""

    def __init__(self) -> None:
        self.sources: defaultdict[str, asyncio.Queue] = defaultdict(asyncio.Queue)
        self.closed: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)

    async def generate(self, model: str, request_id: str, prompt, params) -> AsyncIterator[RequestOutput]:
        try:
            while (item := await self.sources[request_id].get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.closed[request_id].set()


def request(rid: str) -> dict:
    return {"model": "m", "request_id": rid, "prompt": PROMPT, "params": SamplingParams(max_tokens=5), "channel": "f"}


async def running(engine: ScriptedEngine) -> tuple:
    """A replica over ``engine`` with request r1 started on it: (replica, r1's own stream, past its hello)."""
    r = replica(engine)
    stream = ServeStream(r.generate(request("r1")))
    assert await anext(stream) == {"replica": "a"}
    return r, stream


async def settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


async def test_one_engine_steps_outputs_of_several_requests_travel_as_one_channel_item():
    engine = ScriptedEngine()
    r = replica(engine)
    channel = ServeStream(r.channel({"channel": "f", "pin": "a"}))
    assert await anext(channel) == {"replica": "a"}
    first, second = ServeStream(r.generate(request("r1"))), ServeStream(r.generate(request("r2")))
    assert await anext(first) == await anext(second) == {"replica": "a"}  # where each runs: nothing else

    # One engine step: both requests' outputs in the same turn of the loop.
    engine.sources["r1"].put_nowait(output("r1", 1))
    engine.sources["r2"].put_nowait(output("r2", 1))
    item = await anext(channel)
    assert [(rid, out.outputs[0].token_ids) for rid, out in item] == [("r1", [1]), ("r2", [1])]
    assert all(out.prompt_token_ids == PROMPT for _, out in item)

    engine.sources["r1"].put_nowait(output("r1", 2, finished=True))
    engine.sources["r2"].put_nowait(output("r2", 2, finished=True))
    item = await anext(channel)
    assert [(rid, out.outputs[0].token_ids, out.finished) for rid, out in item] == [
        ("r1", [2], True),
        ("r2", [2], True),
    ]
    assert all(out.prompt_token_ids == [] for _, out in item)  # the prompt travels once
    for rid, stream in (("r1", first), ("r2", second)):
        engine.sources[rid].put_nowait(None)
        assert [x async for x in stream] == []  # each request's own stream ends with it
    channel.cancel()


async def test_outputs_made_before_the_channel_opens_wait_for_it():
    engine = ScriptedEngine()
    r, stream = await running(engine)
    engine.sources["r1"].put_nowait(output("r1", 1))
    engine.sources["r1"].put_nowait(output("r1", 2, finished=True))
    engine.sources["r1"].put_nowait(None)
    assert [x async for x in stream] == []  # the request is over before its front end reads the channel
    channel = ServeStream(r.channel({"channel": "f", "pin": "a"}))
    assert await anext(channel) == {"replica": "a"}
    assert [out.outputs[0].token_ids for _, out in await anext(channel)] == [[1], [2]]
    channel.cancel()


async def test_a_request_error_travels_as_data_after_its_outputs():
    engine = ScriptedEngine()
    r, _ = await running(engine)
    channel = ServeStream(r.channel({"channel": "f", "pin": "a"}))
    await anext(channel)
    engine.sources["r1"].put_nowait(output("r1", 1))
    engine.sources["r1"].put_nowait(ConnectorError("too long", status=400, code="context_length_exceeded"))
    items: list = []
    while len(items) < 2:
        items += await anext(channel)
    assert items[0][1].outputs[0].token_ids == [1]
    assert items[1] == (
        "r1",
        {
            "error": {
                "message": "too long",
                "status": 400,
                "type": "invalid_request_error",
                "code": "context_length_exceeded",
                "param": None,
            }
        },
    )
    channel.cancel()


async def test_cancelling_a_requests_stream_closes_its_engine_stream():
    engine = ScriptedEngine()
    _, stream = await running(engine)
    engine.sources["r1"].put_nowait(output("r1", 1))
    await settle()
    stream.cancel()  # what Serve does when the front end cancels (its client left)
    await engine.closed["r1"].wait()  # the engine stream was closed: the request is aborted


async def test_a_channel_ends_once_no_request_of_its_front_end_has_run_here_for_a_while():
    engine = ScriptedEngine()
    r, stream = await running(engine)
    r.channel_idle_s = 0.01
    channel = ServeStream(r.channel({"channel": "f", "pin": "a"}))
    await anext(channel)
    await asyncio.sleep(0.05)  # idle periods pass, but r1 still runs: the channel stays open
    engine.sources["r1"].put_nowait(output("r1", 1, finished=True))
    assert [(rid, out.finished) for rid, out in await anext(channel)] == [("r1", True)]
    engine.sources["r1"].put_nowait(None)
    assert [x async for x in stream] == []
    assert [x async for x in channel] == []  # nothing runs here any more: it ends
    assert r._outboxes == {}


class CountingEngine(StandInEngine):
    """Counts on from the prompt's last token; with ``stall_after``, hangs after that many tokens."""

    def __init__(self, stall_after: int | None = None):
        self.stall_after = stall_after
        self.prompts: list[list[int]] = []

    async def generate(self, model: str, request_id: str, prompt, params) -> AsyncIterator[RequestOutput]:
        self.prompts.append(list(prompt))
        for i in range(params.max_tokens):
            if i == self.stall_after:
                await asyncio.Event().wait()
            await asyncio.sleep(0)
            token = prompt[-1] + i + 1
            done = i + 1 == params.max_tokens
            yield RequestOutput(
                request_id,
                None,
                list(prompt),
                [CompletionOutput(0, str(token), [token], finish_reason="length" if done else None)],
                finished=done,
                delta=True,
                num_generated_tokens=i + 1,
            )


async def test_a_replica_that_dies_mid_stream_is_left_for_another_with_nothing_lost_or_repeated():
    dying, healthy = CountingEngine(stall_after=3), CountingEngine()
    handle = Handle([replica(dying, "a"), replica(healthy, "b")], {"models": [ModelCard("m", "generate", 256)]})
    connector = RayConnector(handle=handle, board_reader=None, prefix_routing=False)
    tokens: list[int] = []
    async for out in connector.generate("m", "req", PROMPT, SamplingParams(max_tokens=8)):
        tokens += out.outputs[0].token_ids
        assert out.prompt_token_ids == PROMPT  # the original prompt, also after the move
        if len(tokens) == 3:
            handle.kill("a", RayActorError())  # SIGKILL: its streams and its channel break
        last = out
    assert tokens == list(range(4, 12))
    assert last.finished and last.num_generated_tokens == 8
    assert healthy.prompts == [[*PROMPT, 4, 5, 6]]  # resumed from what the client had
    assert [g["request_id"] for g in handle.generated] == ["req", "req~m1"]
    connector.shutdown()
