"""Speculative decoding at one stream: an input-grounded task with and without it, in one run.

The task rewrites (or summarizes) a given text of about 500 tokens, greedy,
one request at a time (c=1), where speculative decoding has the most to
gain: the output repeats long stretches of its input, and one-stream decoding
is bound by reading the weights, so verifying k + 1 tokens costs little more
than computing one. The same engine settings run without speculation, with
n-gram prompt lookup and, when --draft-model names one, with a draft model;
the runs alternate (plain, n-gram, draft, plain, ...) so that a change in the
machine's load hits them alike. Prints each variant's output tokens/s (median
of --repeats), its ratio to plain decoding, the acceptance rate (accepted /
proposed tokens) and the mean tokens per step of a speculating sequence, and
checks that every variant's output is plain decoding's, token for token.

    .venv/bin/python bench/spec_decode.py --repeats 5
    .venv/bin/python bench/spec_decode.py --draft-model smollm2-135m-instruct  # a model drafting for itself
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The text to work on: an original passage of about 500 tokens (SmolLM2's tokenizer).
TEXT = """\
The harbour town of Kelmoor sits at the mouth of a narrow river, between two headlands that shelter it \
from the western gales. For most of its history the town lived from fishing. Every morning before dawn \
the boats left the inner harbour, passed the stone lighthouse on the northern headland, and spread out \
over the banks where the cod and the herring gathered. They came back in the afternoon, and the catch \
was sold on the quay to merchants who salted it, packed it in barrels and sent it inland by cart.

In the spring of 1874 a storm destroyed half of the fleet. Eleven boats were lost and nineteen men did \
not come home. The town council met in the church hall and decided to build a breakwater across the \
outer harbour, so that boats caught by bad weather could shelter behind it instead of running for the \
river mouth. The work took six years. The stone came from a quarry on the southern headland and was \
carried down to the shore on a small railway built for the purpose. When the breakwater was finished, \
the railway stayed, and it later carried passengers as well as stone.

The railway changed the town more than the breakwater did. Visitors from the cities arrived in summer \
to walk on the cliffs, bathe in the cove below the quarry and eat fish on the quay. Hotels opened along \
the seafront, and the old net lofts were turned into tea rooms and shops. By 1900 more people in \
Kelmoor earned their living from visitors than from fishing. The fleet grew smaller every decade, and \
the last of the old sailing boats was sold in 1936.

Today the harbour holds more yachts than fishing boats, but the town has kept its character. The \
lighthouse still stands on the northern headland, although its lamp has been automatic since 1982. \
The quarry railway is run by volunteers and takes visitors along the cliffs to the southern headland \
every afternoon from May to September. In the church hall, a small museum tells the story of the storm \
of 1874, with the names of the nineteen men painted on a board above the door. Each year, on the first \
Sunday of April, the people of Kelmoor walk to the end of the breakwater and lay flowers on the water \
in their memory.
"""

TASKS = {
    "rewrite": "Rewrite the following text in plain English, keeping every fact and the order of the paragraphs.",
    "summarize": "Summarize the following text, paragraph by paragraph, keeping its names, dates and numbers.",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft-model", default=None, help="a draft model with the same tokenizer (adds a draft run)")
    ap.add_argument("--task", choices=list(TASKS), default="rewrite")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    import torch

    from servelm import LLM, SamplingParams

    common = {
        "dtype": args.dtype,
        "device": "cpu",
        "kv_cache_memory": 256 << 20,
        "num_speculative_tokens": args.num_speculative_tokens,
    }
    variants = {"plain": {}, "ngram": {"speculative_method": "ngram"}}
    if args.draft_model:
        variants["draft"] = {"speculative_method": "draft", "speculative_model": args.draft_model}
    engines = {name: LLM(args.model, **common, **extra) for name, extra in variants.items()}
    plain = engines["plain"]
    conversation = [{"role": "user", "content": f"{TASKS[args.task]}\n\n{TEXT}"}]
    text = plain.tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    prompt = plain.tokenizer.encode(text, add_special_tokens=False)
    # No prefix cache between runs: every run computes the whole prompt, as a new request would.
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    outputs: dict[str, list[int]] = {}
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for name, llm in engines.items():
        outputs[name] = llm.generate([prompt], params)[0].outputs[0].token_ids  # warm-up, and the output
    before = {name: llm.engine.stats("m") for name, llm in engines.items()}
    for _ in range(args.repeats):
        for name, llm in engines.items():
            llm.engine.block_manager.reset_prefix_cache()
            t0 = time.perf_counter()
            out = llm.generate([prompt], params)[0].outputs[0].token_ids
            rates[name].append(len(out) / (time.perf_counter() - t0))
            assert out == outputs[name]
            print(f"  {name}: {rates[name][-1]:.1f} tok/s", flush=True)

    print(
        f"model {args.model}, {plain.engine.runner.dtype}, cpu threads={torch.get_num_threads()}; "
        f"task {args.task}: {len(prompt)} prompt tokens, {len(outputs['plain'])} output tokens (greedy), "
        f"k={args.num_speculative_tokens}, median of {args.repeats}"
    )
    base = statistics.median(rates["plain"])
    print(f"{'':8s}{'tok/s':>10s}{'ratio':>8s}{'accepted':>10s}{'tok/step':>10s}  output")
    for name, llm in engines.items():
        rate = statistics.median(rates[name])
        after = llm.engine.stats("m")
        drafts = after.spec_decode_drafts - before[name].spec_decode_drafts
        proposed = after.spec_decode_draft_tokens - before[name].spec_decode_draft_tokens
        accepted = after.spec_decode_accepted_tokens - before[name].spec_decode_accepted_tokens
        acceptance = f"{accepted / proposed:.0%}" if proposed else "-"
        per_step = f"{1 + accepted / drafts:.2f}" if drafts else "-"
        same = "identical" if outputs[name] == outputs["plain"] else "DIFFERS"
        print(f"{name:8s}{rate:10.1f}{rate / base:7.2f}x{acceptance:>10s}{per_step:>10s}  {same}")


if __name__ == "__main__":
    main()
