"""Decoding steps through CUDA graphs: the padded, bucketed steps give the eager engine's tokens.

On a GPU (``device="auto"`` finds it) the graphs are recorded and replayed.
A CPU records no CUDA graphs, so there the same buffers, padding and
buckets run eagerly (``record=False``): everything but the recording itself.
"""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from servelm import LLM, SamplingParams, kernels
from servelm.engine import cuda_graphs
from servelm.engine.cuda_graphs import DecodeGraphs
from servelm.engine.device import resolve_device
from servelm.engine.kv_cache import allocate_kv_caches

pytestmark = pytest.mark.model

MODEL = "smollm2-135m-instruct"
ON_GPU = resolve_device("auto").type == "cuda"


def _engine(graphs: bool) -> LLM:
    llm = LLM(MODEL, dtype="float32", device="auto", cuda_graphs=graphs, kv_cache_memory=64 << 20, max_num_seqs=8)
    runner = llm.engine.runner
    if graphs and not ON_GPU:
        # What the runner sets up on CUDA: a scratch block past the block manager's, and the graphs' buffers.
        runner.kv_caches = allocate_kv_caches(
            runner.model_config, runner.num_blocks + 1, runner.block_size, runner.dtype, runner.device
        )
        graphs = DecodeGraphs(
            runner.model, runner.kv_caches, 8, runner.max_model_len, runner.block_size, runner.num_blocks, record=False
        )
        runner.graphs = runner.record_graphs(graphs)
    return llm


def _replays(graphs: DecodeGraphs) -> Counter:
    """Counts each bucket's replays from now on."""
    counts: Counter = Counter()

    def counted(key, step):
        def replay():
            counts[key] += 1
            return step()

        return replay

    graphs.steps = {key: counted(key, step) for key, step in graphs.steps.items()}
    return counts


@pytest.fixture(params=["native", "torch"] if not ON_GPU else ["cuda"])
def ops(request, monkeypatch):
    """On CPU, both attention paths: the native kernels' and PyTorch's (the one CUDA takes)."""
    if request.param == "torch":
        monkeypatch.setattr(kernels, "cpu_kernels", lambda: None)
    return request.param


def _workload(llm: LLM) -> tuple[list[list[int]], list[SamplingParams]]:
    """Seven prompts of mixed lengths whose requests end one after another, so that the batch shrinks
    through several buckets and padding rows keep taking over rows that held real sequences."""
    base = llm.tokenizer.encode(" ".join(f"entry {i} reads {i * 5 % 11}." for i in range(60)))
    prompts = [base[: 4 + i * 29] for i in range(7)]
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(7)]
    return prompts, params


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.usefixtures("ops")
def test_padded_decode_steps_give_the_eager_engines_tokens():
    eager, graphed = _engine(False), _engine(True)
    graphs = graphed.engine.runner.graphs
    # Every bucket was recorded at start-up: no step waits for a recording while serving.
    recorded = set(graphs.steps)
    assert recorded == {(size, blocks) for size in (1, 2, 4, 8) for blocks in _powers_up_to(graphs.max_blocks)}
    replays = _replays(graphs)
    prompts, params = _workload(eager)
    expected = _tokens(eager.generate(prompts, params))
    assert _tokens(graphed.generate(prompts, params)) == expected
    assert set(graphs.steps) == recorded
    # The batch went through several batch buckets, padded where it fell between them.
    assert len({size for size, _blocks in replays}) >= 3
    # The finished requests' blocks stay in the prefix cache; had a padding row written into one,
    # a request that reuses it would go astray.
    again = graphed.generate(prompts[-2:], params[-2:])
    assert [o.num_cached_tokens > 0 for o in again] == [True, True]
    assert _tokens(again) == expected[-2:]


def test_buckets_are_powers_of_two_up_to_the_limits():
    graphs = _engine(True).engine.runner.graphs
    block = graphs.block_size
    assert graphs.bucket(1, 1) == (1, 1)
    assert graphs.bucket(3, 2 * block + 1) == (4, 4)
    assert graphs.bucket(8, 4 * block) == (8, 4)
    # Never more blocks than the longest context has, nor more sequences than max_num_seqs: past them, eager.
    assert graphs.bucket(5, graphs.max_blocks * block) == (8, graphs.max_blocks)
    assert graphs.bucket(5, graphs.max_blocks * block + 1) is None
    assert graphs.bucket(9, 1) is None


def test_buckets_past_the_start_up_limit_are_recorded_when_first_needed(monkeypatch):
    eager = _engine(False)
    block = eager.engine.runner.block_size
    monkeypatch.setattr(cuda_graphs, "STARTUP_TOKENS", 4 * block)  # batch x KV blocks of at most 4
    graphed = _engine(True)
    graphs = graphed.engine.runner.graphs
    at_start = set(graphs.steps)
    assert at_start == {(size, blocks) for size in (1, 2, 4) for blocks in (1, 2, 4) if size * blocks <= 4}
    prompts, params = _workload(eager)
    assert _tokens(graphed.generate(prompts, params)) == _tokens(eager.generate(prompts, params))
    assert any(size * blocks > 4 for size, blocks in set(graphs.steps) - at_start)


@pytest.mark.parametrize("when", ["at start-up", "mid-run"])
def test_a_graph_that_cannot_be_recorded_leaves_the_engine_decoding_eagerly(monkeypatch, caplog, when):
    eager = _engine(False)

    def refuse(self, size, blocks):
        raise RuntimeError("operation not permitted when stream is capturing")

    if when == "at start-up":
        monkeypatch.setattr(DecodeGraphs, "_recorded", refuse)
    else:  # one of the largest buckets, recorded when first needed
        monkeypatch.setattr(cuda_graphs, "STARTUP_TOKENS", eager.engine.runner.block_size)
    with caplog.at_level(logging.ERROR, logger="servelm.engine.model_runner"):
        graphed = _engine(True)
        if when == "mid-run":
            assert graphed.engine.runner.graphs is not None
            monkeypatch.setattr(DecodeGraphs, "_recorded", refuse)
        prompts, params = _workload(eager)
        assert _tokens(graphed.generate(prompts, params)) == _tokens(eager.generate(prompts, params))
    assert graphed.engine.runner.graphs is None
    assert "decoding without CUDA graphs" in caplog.text


def _powers_up_to(limit: int) -> set[int]:
    return {min(1 << i, limit) for i in range(limit.bit_length() + 1)}
