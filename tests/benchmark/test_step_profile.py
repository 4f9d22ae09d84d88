"""bench/step_profile.py: each step's FLOPs add up to the requests', and a tiny run prints every figure."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from benchmark.bench_scripts import bench_script

step_profile = bench_script("step_profile")
model_cost = bench_script("model_cost")

pytestmark = pytest.mark.model


def test_the_steps_flops_add_up_to_the_requests():
    """Prefill chunks, decodes and the LM head's rows, step by step, as model_cost counts a whole request."""
    from servelm import LLM, SamplingParams

    llm = LLM("smollm2-135m-instruct", dtype="bfloat16", kv_cache_memory=64 << 20, max_num_batched_tokens=32)
    cost = model_cost.ModelCost.from_hf_config(dataclasses.asdict(llm.engine.runner.model_config))
    clock = step_profile.StepClock(llm, cost)
    prompts = torch.randint(200, cost.vocab, (3, 20), generator=torch.Generator().manual_seed(0)).tolist()
    llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    assert any(s.prefill_tokens and s.decodes for s in clock.steps)  # chunks of 32 tokens: mixed steps too
    assert sum(s.flops for s in clock.steps) == pytest.approx(3 * cost.request_flops(20, 5), rel=1e-12)
    decoding = [s for s in clock.steps if s.decodes]
    assert all(0 < s.decode_attention_flops < s.flops for s in decoding)
    assert all(set(s.parts) == {"forward", "logits", "sample"} for s in decoding)


def test_tiny_run_prints_the_groups_the_decode_step_and_the_ceiling(capsys: pytest.CaptureFixture[str]):
    args = ["--gemm", "64x64x64", "--num-prompts", "3", "--input-len", "12", "--output-len", "4"]
    assert step_profile.main([*args, "--max-num-seqs", "3", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^bf16 GEMM peak \d+\.\d G/s", out, re.M)
    assert re.search(r"\d+ steps, .* output tok/s, \d+ G/s = \d+\.\d% of the peak", out)
    assert re.search(r"^  decode-only +\d+ steps", out, re.M)
    assert re.search(r"a decode step of 3 rows, medians of \d+: [\d.]+ ms = forward [\d.]+ \+ LM head", out)
    from servelm import kernels

    if kernels.cpu_kernels() is not None:
        assert re.search(r"ceiling: .* = [\d.]+ s: \d+\.\d% of the peak \(measured \d+\.\d%\)", out)
