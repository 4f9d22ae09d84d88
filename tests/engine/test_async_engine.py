"""The async engine: concurrent streams, abort, per-request failures."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest

from servelm import SamplingParams
from servelm.engine.async_engine import AsyncLLMEngine
from servelm.engine.outputs import accumulate
from servelm.engine.structured_outputs import StructuredOutputsError, StructuredOutputsParams

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def engine(llm):
    eng = AsyncLLMEngine(llm.engine)
    eng.start()
    yield eng
    eng.shutdown()


async def _collect(engine, rid, prompt, params):
    total = None
    deltas = 0
    async for out in engine.generate(rid, prompt, params):
        total = accumulate(total, out)
        deltas += 1
    return total, deltas


async def test_concurrent_streams_match_one_at_a_time(engine):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [f"Fact number {i}:" for i in range(6)]
    # One at a time first (the engine thread owns the engine: no direct calls while it runs).
    expected = [(await _collect(engine, f"a{i}", p, params))[0].outputs[0].token_ids for i, p in enumerate(prompts)]
    results = await asyncio.gather(*(_collect(engine, f"c{i}", p, params) for i, p in enumerate(prompts)))
    for (total, deltas), exp in zip(results, expected):
        assert total.finished
        assert total.outputs[0].token_ids == exp
        assert deltas > 1  # streamed, not one final blob
        assert total.num_generated_tokens == 10


async def test_leaving_the_stream_aborts_and_frees_blocks(engine):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    stream = engine.generate("leaver", "Write a very long essay:", params)
    async for _ in stream:
        # Held from submission: a Ray replica lists these ids beside its queue figures.
        assert engine.request_ids() == {"leaver"}
        break
    await stream.aclose()
    assert engine.request_ids() == set()
    bm = engine.engine.block_manager
    for _ in range(100):
        if not engine.engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.02)
    assert not engine.engine.has_unfinished_requests()
    assert bm.usage == 0


async def test_bad_request_fails_before_first_output_and_loop_survives(engine):
    from servelm.engine.llm_engine import PromptTooLongError

    n = engine.engine.max_model_len
    with pytest.raises(PromptTooLongError):
        async for _ in engine.generate("too-long", [1] * (n + 1), SamplingParams(max_tokens=1)):
            pass
    total, _ = await _collect(engine, "after", "Hello", SamplingParams(temperature=0.0, max_tokens=3))
    assert total.finished and len(total.outputs[0].token_ids) == 3


async def test_failing_step_fails_its_requests_only(engine, monkeypatch, caplog):
    runner = engine.engine.runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(out, sampling, want, *proposals):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault")
        return real(out, sampling, want, *proposals)

    monkeypatch.setattr(runner, "execute", flaky)
    with caplog.at_level(logging.ERROR, logger="servelm.engine.llm_engine"):
        total, _ = await _collect(engine, "victim", "Hello there", SamplingParams(temperature=0.0, max_tokens=5))
    # The client hears which request failed, never how: that is in the log, under its id.
    assert total.error and "victim" in total.error and "injected fault" not in total.error
    assert "injected fault" in caplog.text and "victim" in caplog.text
    assert total.outputs[0].finish_reason == "error"
    monkeypatch.setattr(runner, "execute", real)
    total, _ = await _collect(engine, "survivor", "Hello there", SamplingParams(temperature=0.0, max_tokens=5))
    assert total.error is None and total.outputs[0].finish_reason == "length"
    assert engine.is_alive


async def test_a_request_whose_sampling_fails_fails_alone(engine, monkeypatch):
    """Three requests share steps; sampling raises whenever the culprit's row is in the batch.

    The culprit fails with an error naming it; the bystanders finish with
    exactly the tokens they get when run alone.
    """
    from servelm.engine.sampler import Sampler

    culprit_seed = 4242
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = ["The sky is", "Two plus two is"]
    alone = [(await _collect(engine, f"alone{i}", p, params))[0].outputs[0].token_ids for i, p in enumerate(prompts)]

    runner = engine.engine.runner
    real = runner.sampler

    class Fragile(Sampler):
        def __call__(self, logits, states):
            if any(s.params.seed == culprit_seed for s in states):
                raise RuntimeError("injected sampler fault")
            return real(logits, states)

    monkeypatch.setattr(runner, "sampler", Fragile())
    bad = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, seed=culprit_seed)
    results = await asyncio.gather(
        _collect(engine, "by0", prompts[0], params),
        _collect(engine, "culprit", "Hello there", bad),
        _collect(engine, "by1", prompts[1], params),
    )
    (by0, _), (culprit, _), (by1, _) = results
    assert culprit.error and "culprit" in culprit.error and "injected" not in culprit.error
    for total, expected in ((by0, alone[0]), (by1, alone[1])):
        assert total.error is None and total.outputs[0].finish_reason == "length"
        assert total.outputs[0].token_ids == expected
    assert engine.is_alive


async def test_a_compiling_grammar_does_not_hold_up_other_requests(engine, monkeypatch):
    grammars = engine.engine.grammars
    compiling, release = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    real_compile = grammars.compile

    def held_compile(spec):
        loop.call_soon_threadsafe(compiling.set)
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(120)
        return real_compile(spec)

    monkeypatch.setattr(grammars, "compile", held_compile)
    regex = "[a-z]{2,5} compiled while others ran"  # a spec no other test compiled
    # max_tokens leaves room for the longest match spelled a character per token.
    params = SamplingParams(temperature=0.7, max_tokens=48, structured_outputs=StructuredOutputsParams(regex=regex))
    held = asyncio.create_task(_collect(engine, "held", "Say something:", params))
    await compiling.wait()
    # The grammar is still compiling; an unconstrained request runs to its end meanwhile.
    free, _ = await _collect(
        engine, "free", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )
    assert free.finished and len(free.outputs[0].token_ids) == 8
    assert not held.done()
    release.set()
    total, _ = await held
    assert re.fullmatch(regex, total.outputs[0].text) and total.outputs[0].finish_reason == "stop"


async def test_a_grammar_that_does_not_compile_fails_before_the_first_output(engine):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= undefined_rule"))
    with pytest.raises(StructuredOutputsError) as info:
        await _collect(engine, "bad-grammar", "x", params)
    assert info.value.param == "structured_outputs.grammar"
    ok, _ = await _collect(
        engine, "after", "x", SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="ab"))
    )
    assert ok.outputs[0].text == "ab"
