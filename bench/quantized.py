"""Weight-only int8 against float32 (and bfloat16 for scale): batch-1 decode speed and greedy agreement.

int8 runs twice: over float32 activations, and over bfloat16 ones (what
``--quantization int8`` runs where ``--dtype auto`` picks bfloat16).

Each prompt is generated greedily one request at a time (batch 1, where the
int8 kernel runs) with each variant. Prints batch-1 output tokens/s for each
(median of --repeats) and its ratio to float32, and how far its greedy
outputs follow float32's: the share of completions identical token for
token, and the mean share of tokens before the first difference. bfloat16
shows how much a small model's greedy text moves with rounding alone.

    .venv/bin/python bench/quantized.py --tokens 32 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colors are",
    "Translate to French: I like cheese.",
    "<|im_start|>user\nName a planet.<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 4, 5,",
    "Water boils at a temperature of",
    "The best way to learn a new language is",
    "import numpy as np\n\ndef softmax(x):",
    "A haiku about the sea:",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from servelm import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    results = {}
    variants = {
        "float32": ("float32", "none"),
        "bfloat16": ("bfloat16", "none"),
        "int8": ("float32", "int8"),  # float32 activations
        "int8-bf16": ("bfloat16", "int8"),  # what --quantization int8 runs where --dtype auto is bfloat16
    }
    for name, (dtype, quantization) in variants.items():
        llm = LLM(args.model, dtype=dtype, device="cpu", kv_cache_memory=256 << 20, quantization=quantization)
        llm.generate(PROMPTS[0], greedy)  # warm-up
        rates, outputs = [], []
        for _ in range(args.repeats):
            outputs = []
            t0 = time.perf_counter()
            for prompt in PROMPTS:
                outputs.append(llm.generate(prompt, greedy)[0].outputs[0].token_ids)
            rates.append(len(PROMPTS) * args.tokens / (time.perf_counter() - t0))
        results[name] = (statistics.median(rates), outputs)
        print(f"{name:>9}: batch-1 decode {results[name][0]:.1f} tok/s", flush=True)

    fp_rate, fp_out = results["float32"]
    for name in ("bfloat16", "int8", "int8-bf16"):
        rate, out = results[name]
        identical = sum(a == b for a, b in zip(fp_out, out))
        prefix = [
            next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) / len(a) for a, b in zip(fp_out, out)
        ]
        print(
            f"{name} vs float32: {rate / fp_rate:.2f}x batch-1 speed; greedy: {identical}/{len(PROMPTS)} completions "
            f"identical, {100 * statistics.mean(prefix):.0f}% of tokens before the first difference on average"
        )


if __name__ == "__main__":
    main()
