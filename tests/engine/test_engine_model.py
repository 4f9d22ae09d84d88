"""The engine on the real bundled model: equality with transformers, batching, caching, preemption."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from servelm import LLM, SamplingParams

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colors are",
    "Translate to French: I like cheese.",
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a planet.<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 4, 5,",
    "Water boils at a temperature of",
]

# min_tokens bans EOS as transformers' min_new_tokens does, so both run 32 tokens.
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32)


def _hf_greedy(hf_reference, prompt: str, n: int) -> list[int]:
    model, tok = hf_reference
    ids = tok(prompt, return_tensors="pt").input_ids.to(model.device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, ids.shape[1] :].tolist()


def test_greedy_matches_transformers(llm, hf_reference):
    outputs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outputs):
        expected = _hf_greedy(hf_reference, prompt, 32)
        assert out.outputs[0].token_ids == expected, prompt
        assert out.outputs[0].text == hf_reference[1].decode(expected, skip_special_tokens=True)
        assert out.outputs[0].finish_reason == "length"


def _mixed_prompts(llm, count: int) -> list[list[int]]:
    # Mixed lengths, from a few tokens to a few hundred, so chunks cut through prompts.
    base = llm.tokenizer.encode(" ".join(f"item {i} is {i * 7 % 13}." for i in range(80)))
    return [base[: 3 + (i * 37) % 300] for i in range(count)]


def test_batch_invariance_with_chunked_prefill():
    llm = LLM(
        "smollm2-135m-instruct",
        dtype="float32",
        max_num_batched_tokens=64,
        max_num_seqs=16,
        kv_cache_memory=256 << 20,
        enable_prefix_caching=False,
    )
    prompts = _mixed_prompts(llm, 16)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert together == alone
    # The budget forced chunking: the longest prompt needs several steps.
    assert max(len(p) for p in prompts) > 64


def test_a_resumed_request_continues_as_without_the_cut_under_output_penalties(llm):
    # A Ray replica failover sends the prompt plus the tokens generated so far
    # (servelm/connectors/ray_resume.py); the frequency and presence penalties
    # must still count those tokens as output, or greedy text changes at the cut.
    prompt = llm.tokenizer.encode("List ten famous landmarks, one per line:\n1.")
    params = SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5
    )
    whole = llm.generate([prompt], params)[0].outputs[0].token_ids
    cut = 15
    resumed = SamplingParams(
        temperature=0.0,
        max_tokens=40 - cut,
        ignore_eos=True,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        prior_output_token_ids=whole[:cut],
    )
    rest = llm.generate([prompt + whole[:cut]], resumed)[0].outputs[0].token_ids
    assert whole[:cut] + rest == whole
    # Without them the penalties start afresh at the cut, and this text does change there.
    forgetful = dataclasses.replace(resumed, prior_output_token_ids=[])
    assert llm.generate([prompt + whole[:cut]], forgetful)[0].outputs[0].token_ids != rest


def test_prefix_cache_reuses_blocks(llm):
    prompt = llm.tokenizer.encode("A long shared system prompt. " * 20)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    hits_before = llm.engine.block_manager.prefix_cache_hits
    second = llm.generate([prompt], params)[0]
    block = llm.engine.config.block_size
    full_blocks = len(prompt) // block
    expected_cached = min(full_blocks * block, len(prompt) - 1)
    assert second.num_cached_tokens == expected_cached
    assert llm.engine.block_manager.prefix_cache_hits - hits_before >= expected_cached
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_stats_count_prefix_cache_lookups_and_queue_time(llm):
    engine = llm.engine
    prompt = llm.tokenizer.encode("Another shared prefix for the statistics. " * 8)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    before = engine.stats("m")
    outs = llm.generate([prompt, prompt], params)
    after = engine.stats("m")
    assert after.model == "m"
    # Every prompt token is looked up once; the second request's hits are its cached tokens.
    assert after.prefix_cache_queries - before.prefix_cache_queries == 2 * len(prompt)
    assert after.prefix_cache_hits - before.prefix_cache_hits == sum(o.num_cached_tokens for o in outs)
    assert (after.num_running, after.num_waiting, after.kv_cache_usage) == (0, 0, 0.0)
    for out in outs:
        assert out.queue_time is not None and out.queue_time >= 0


def test_preemption_gives_same_output():
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = LLM("smollm2-135m-instruct", dtype="float32", kv_cache_memory=256 << 20)
    prompts = _mixed_prompts(roomy, 8)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    # Room for about two of these requests at once: the rest must wait or be preempted.
    block_bytes = roomy.engine.runner.block_bytes
    tight = LLM("smollm2-135m-instruct", dtype="float32", kv_cache_memory=block_bytes * 40, enable_prefix_caching=False)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert tight.engine.block_manager.num_free_blocks == tight.engine.block_manager.num_blocks


def test_seeded_sampling_reproducible_in_any_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    noise = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["Tell me a story about"], seeded)[0].outputs[0].token_ids
    batch = llm.generate(["Tell me a story about", "Hello", "Why is the sky"], [seeded, noise, noise])
    assert batch[0].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.9, seed=4321, max_tokens=16, ignore_eos=True)
    assert llm.generate(["Tell me a story about"], other_seed)[0].outputs[0].token_ids != alone


def test_stop_string_trims_and_reports(llm):
    greedy = llm.generate(["1, 2, 3, 4, 5,"], SamplingParams(temperature=0.0, max_tokens=20))[0]
    text = greedy.outputs[0].text
    assert " 8" in text, text  # the model counts on; stop at a string that spans tokens
    stop = text[text.index(" 8") - 1 : text.index(" 8") + 3]
    out = llm.generate(["1, 2, 3, 4, 5,"], SamplingParams(temperature=0.0, max_tokens=20, stop=[stop]))[0]
    choice = out.outputs[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    assert choice.text == text[: text.index(stop)]


def test_n_choices_and_best_of(llm):
    out = llm.generate(["Write a word:"], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    best = llm.generate(["Write a word:"], SamplingParams(n=1, best_of=3, temperature=1.0, seed=7, max_tokens=8))[0]
    assert len(best.outputs) == 1
    assert best.outputs[0].cumulative_logprob == max(c.cumulative_logprob for c in out.outputs)


def test_logprobs_and_prompt_logprobs(llm, hf_model):
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    out = llm.generate(["The capital of France is"], params)[0]
    choice = out.outputs[0]
    assert len(choice.logprobs) == 4
    for pos in choice.logprobs:
        assert len(pos.top) == 3
        assert pos.top[0].token_id == pos.chosen.token_id  # greedy picks the most likely
        assert pos.top[0].logprob >= pos.top[1].logprob >= pos.top[2].logprob
    assert out.prompt_logprobs[0] is None
    assert all(p is not None for p in out.prompt_logprobs[1:])
    # The prompt logprobs equal transformers' for the same tokens.
    model, _tok = hf_model
    ids = torch.tensor([out.prompt_token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    for pos in range(1, len(out.prompt_token_ids)):
        expected = ref[pos - 1, out.prompt_token_ids[pos]].item()
        assert out.prompt_logprobs[pos].chosen.logprob == pytest.approx(expected, abs=1e-3)


def test_prompt_too_long_states_both_numbers(llm):
    from servelm.engine.llm_engine import PromptTooLongError

    n = llm.engine.max_model_len
    with pytest.raises(PromptTooLongError) as err:
        llm.generate([[1] * (n - 5)], SamplingParams(max_tokens=10))
    assert str(n) in str(err.value) and str(n - 5) in str(err.value)


def test_abort_frees_all_blocks(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request("a", "Count to one hundred:", params)
    engine.add_request("b", "Say something long:", params)
    for _ in range(3):
        engine.step()
    assert engine.block_manager.usage > 0
    engine.abort_request("a")
    engine.abort_request("b")
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.usage == 0


def test_default_max_tokens_fits_a_cache_smaller_than_the_context():
    small = LLM("smollm2-135m-instruct", dtype="float32", kv_cache_memory=2 << 20)
    capacity = small.engine.block_manager.capacity_tokens
    assert capacity < small.engine.max_model_len
    # No max_tokens: the request is admitted and stops at EOS or at what the cache can hold.
    out = small.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=None, stop=["."]))[0]
    assert out.outputs[0].finish_reason in ("stop", "length")
    from servelm.engine.llm_engine import InvalidPromptError

    with pytest.raises(InvalidPromptError, match="can never fit in the KV cache"):
        small.generate(["Hi"], SamplingParams(max_tokens=capacity + 10))


def test_prompt_token_ids_outside_the_vocabulary_are_refused(llm):
    from servelm.engine.llm_engine import InvalidPromptError

    vocab = llm.engine.runner.model_config.vocab_size
    assert llm.engine.prepare_prompt([1, vocab - 1], SamplingParams(max_tokens=4)) == [1, vocab - 1]
    with pytest.raises(
        InvalidPromptError, match=rf"^prompt token id {vocab} is outside the vocabulary \[0, {vocab}\)$"
    ):
        llm.engine.prepare_prompt([1, vocab], SamplingParams(max_tokens=4))
