"""Offline throughput: servelm's engine against Hugging Face ``generate``, in one run.

N prompts of fixed input length and fixed output length (EOS ignored). Prints
output tokens per second for servelm (all N batched by the engine), HF
``generate`` one request at a time, HF ``generate`` batched, and batch-1
decode for both, then the ratios. Each figure is the median of --repeats runs.

    .venv/bin/python bench/offline.py --num-prompts 64 --input-len 128 --output-len 128
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Skip the lowest ids: SmolLM2 keeps its special tokens there.
    return torch.randint(200, vocab, (n, length), generator=g).tolist()


def _median_rate(fn, tokens: int, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        rates.append(tokens / (time.perf_counter() - t0))
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-single", type=int, default=2, help="requests HF runs one at a time (its rate is per request)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--dtype",
        default="auto",
        help="float32, bfloat16, float16 or auto (servelm's choice for this CPU; HF runs the same)",
    )
    ap.add_argument("--hf-dtype", default=None, help="dtype of the HF baseline (default: --dtype's)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from servelm import LLM, SamplingParams
    from servelm.engine.device import resolve_dtype
    from servelm.models.registry import resolve_model_path

    llm = LLM(
        args.model,
        dtype=args.dtype,
        device="cpu",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=2 << 30,
    )
    dtype = llm.engine.runner.dtype  # what --dtype (auto included) resolved to
    vocab = llm.engine.runner.model_config.vocab_size
    prompts = _prompts(vocab, args.num_prompts, args.input_len, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    hf_dtype = resolve_dtype(args.hf_dtype, torch.device("cpu")) if args.hf_dtype else dtype
    path = resolve_model_path(args.model)
    if path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=hf_dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=hf_dtype)
    hf.eval()

    def hf_generate(batch: list[list[int]]) -> None:
        ids = torch.tensor(batch)
        with torch.no_grad():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
                pad_token_id=0,
            )

    n_out = args.num_prompts * args.output_len
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    servelm_rate = _median_rate(lambda: llm.generate(prompts, params), n_out, args.repeats)
    servelm_b1 = _median_rate(lambda: llm.generate(prompts[:1], params), args.output_len, args.repeats)
    hf_generate(prompts[:1])  # warm-up
    hf_b1 = _median_rate(lambda: hf_generate(prompts[:1]), args.output_len, args.repeats)
    single = prompts[: args.hf_single]
    hf_single = _median_rate(lambda: [hf_generate([p]) for p in single], len(single) * args.output_len, args.repeats)
    hf_batched = _median_rate(lambda: hf_generate(prompts), n_out, args.repeats)

    print(f"model {args.model}, servelm {dtype}, HF {hf_dtype}, cpu threads={torch.get_num_threads()}")
    print(
        f"{args.num_prompts} requests x {args.input_len} prompt + {args.output_len} output tokens, "
        f"median of {args.repeats}"
    )
    print(f"{'':34s}{'output tok/s':>14s}")
    print(f"{'servelm, all requests batched':34s}{servelm_rate:14.1f}")
    print(f"{'HF generate, one at a time':34s}{hf_single:14.1f}")
    print(f"{'HF generate, batched':34s}{hf_batched:14.1f}")
    print(f"{'servelm, batch 1':34s}{servelm_b1:14.1f}")
    print(f"{'HF generate, batch 1':34s}{hf_b1:14.1f}")
    print(f"ratio servelm / HF one at a time: {servelm_rate / hf_single:.2f}x")
    print(f"ratio servelm / HF batched:       {servelm_rate / hf_batched:.2f}x")
    print(f"ratio batch-1 servelm / HF:       {servelm_b1 / hf_b1:.2f}x")


if __name__ == "__main__":
    main()
