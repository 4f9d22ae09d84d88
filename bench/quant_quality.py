"""What quantization costs in quality: greedy agreement with bfloat16 and perplexity on a fixed text.

For each mode (bfloat16 unquantized, ``--quantization int8``, ``--quantization
w8a8``, all over bfloat16 activations on the CPU; a mode ending in ``+kv8``
also keeps the KV cache in int8, ``--kv-cache-dtype int8``) the bundled model:

- completes bench/quantized.py's 12 prompts greedily, ``--tokens`` tokens each
  (EOS ignored), all prompts in one batch (so prefill and decoding run the
  batched paths, where w8a8 multiplies in int8); each quantized mode's
  tokens are compared with bfloat16's: tokens identical at the same position,
  tokens before the first difference, completions identical;
- scores ``TEXT`` below (prompt logprobs, teacher-forced): perplexity
  ``exp(-mean log p(token | tokens before))`` over every token after the first;
  with ``--text-file``, also each file's first ``--text-tokens`` tokens
  (whitespace collapsed), and the geometric mean of every text's perplexity.

    .venv/bin/python bench/quant_quality.py
    .venv/bin/python bench/quant_quality.py --tokens 64 --modes none w8a8
    .venv/bin/python bench/quant_quality.py --modes none none+kv8 w8a8 w8a8+kv8
    .venv/bin/python bench/quant_quality.py --text-file /usr/share/common-licenses/{GPL-3,Apache-2.0,MPL-2.0,GFDL-1.3}
"""

from __future__ import annotations

import argparse
import math
import os
import statistics

from quantized import PROMPTS

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# A fixed text of plain technical English (written for this benchmark), a few hundred tokens.
TEXT = (
    "A bridge is a structure that carries a road, a path or a railway across an obstacle such as a river, "
    "a valley or another road. The simplest bridge is a beam resting on two supports: the load bends the "
    "beam, so that its upper side is squeezed and its lower side is stretched. Stone resists squeezing well "
    "but breaks when it is stretched, which is why the builders of the past made arches, in which every "
    "stone is pressed against its neighbours and none is pulled apart. An arch pushes outwards at its feet, "
    "and the ground or the next arch must push back. Iron and later steel changed the choices, because they "
    "resist stretching as well as squeezing. A truss bridge joins short straight bars into triangles, the "
    "one shape that cannot change without changing the length of a side, so that each bar is only pulled "
    "or pushed along its length. A suspension bridge hangs its deck from cables draped between tall towers; "
    "the cables are anchored in massive blocks at both ends and carry the whole weight in tension. For the "
    "longest spans it is the only practical form. Engineers check a design against the heaviest traffic it "
    "may carry, the strongest wind it may meet and the movement of the ground in an earthquake, and they add "
    "a margin for what they cannot foresee. Wind matters more than one might expect: a light deck can start "
    "to twist and swing when the wind blows steadily across it, and the swinging can grow until the deck "
    "fails. Modern decks are shaped and stiffened so that the air flows past them without feeding such "
    "motion. A bridge also ages. Water seeps into concrete and rusts the steel inside, salt from winter roads "
    "speeds the damage, and repeated loads open small cracks that slowly grow. Inspectors visit each bridge "
    "at regular intervals, measure what has changed, and decide whether it needs repair, a lower weight "
    "limit, or replacement."
)

MODES = ("none", "int8", "w8a8", "none+kv8", "w8a8+kv8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="quantization modes to run")
    ap.add_argument("--text-file", nargs="*", default=[], help="more texts to score, one per file")
    ap.add_argument("--text-tokens", type=int, default=2000, help="tokens scored of each --text-file")
    args = ap.parse_args()
    texts = {"TEXT": TEXT}
    for path in args.text_file:
        with open(path, encoding="utf-8") as f:
            texts[os.path.basename(path)] = " ".join(f.read().split())

    from servelm import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    tokens, perplexity = {}, {}
    for mode in args.modes:
        llm = LLM(
            args.model,
            dtype="bfloat16",
            device="cpu",
            kv_cache_memory=256 << 20,
            quantization=mode.removesuffix("+kv8"),
            kv_cache_dtype="int8" if mode.endswith("+kv8") else "auto",
            enable_prefix_caching=False,
            max_model_len=max(4096, args.text_tokens + 1),
        )
        tokens[mode] = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, greedy)]
        by_text = {}
        for name, text in texts.items():
            scored = llm.generate(llm.tokenizer.encode(text)[: args.text_tokens], score)[0].prompt_logprobs
            logprobs = [p.chosen.logprob for p in scored if p is not None]
            by_text[name] = math.exp(-statistics.mean(logprobs))
            print(f"{mode:>8}: perplexity {by_text[name]:.3f} over {len(logprobs)} tokens of {name}", flush=True)
        perplexity[mode] = math.exp(statistics.mean(math.log(v) for v in by_text.values()))
        if len(texts) > 1:
            print(f"{mode:>8}: perplexity {perplexity[mode]:.3f}, the geometric mean over {len(texts)} texts")
        del llm

    if "none" not in tokens:
        return
    base = tokens["none"]
    total = sum(len(t) for t in base)
    for mode in (m for m in args.modes if m != "none"):
        same = sum(x == y for a, b in zip(base, tokens[mode]) for x, y in zip(a, b))
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(base, tokens[mode])]
        identical = sum(a == b for a, b in zip(base, tokens[mode]))
        print(
            f"{mode:>8} vs bfloat16: {100 * same / total:.1f}% of tokens identical at the same position, "
            f"{100 * sum(prefix) / total:.1f}% before the first difference, {identical}/{len(base)} completions "
            f"identical; perplexity {perplexity[mode]:.3f} vs {perplexity['none']:.3f} "
            f"({100 * (perplexity[mode] / perplexity['none'] - 1):+.2f}%)"
        )


if __name__ == "__main__":
    main()
