"""Offline throughput: servelm's engine against Hugging Face ``generate``, in one run.

N prompts of fixed input length and fixed output length (EOS ignored). Prints
output tokens per second for servelm (all N batched by the engine), HF
``generate`` one request at a time, HF ``generate`` batched, and batch-1
decode for both, then the ratios. Each figure is the median of --repeats runs.
With ``--against MODE`` a second servelm engine runs with ``--quantization
MODE`` beside the first (with ``--against-dtype DTYPE``, in that dtype), their
runs alternating (one of each per repeat, so that a change in the machine's
load hits both), and the ratio is printed; ``--no-hf`` leaves the HF runs out
(alone, it prints servelm's own figures).

    .venv/bin/python bench/offline.py --num-prompts 64 --input-len 128 --output-len 128
    .venv/bin/python bench/offline.py --dtype bfloat16 --against w8a8 --no-hf --no-prefix-caching --repeats 5
    .venv/bin/python bench/offline.py --dtype float32 --against-dtype bfloat16 --no-hf --no-prefix-caching
    python bench/offline.py --device cuda --num-prompts 256 --hf-single 8   # on a GPU, HF on it too
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from servelm.engine.config import QUANTIZATIONS


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Skip the lowest ids: SmolLM2 keeps its special tokens there.
    return torch.randint(200, vocab, (n, length), generator=g).tolist()


def _median_rate(fn, tokens: int, repeats: int) -> float:
    return _interleaved_rates([fn], tokens, repeats)[0]


def _interleaved_rates(fns: list, tokens: int, repeats: int) -> list[float]:
    """Each function's median rate over ``repeats`` rounds, one call of each function per round."""
    rates: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, fn_rates in zip(fns, rates):
            t0 = time.perf_counter()
            fn()
            fn_rates.append(tokens / (time.perf_counter() - t0))
    return [statistics.median(r) for r in rates]


def _where(device: torch.device, cuda_graphs: bool) -> str:
    if device.type == "cuda":
        return f"device {torch.cuda.get_device_name(device)}, CUDA graphs {'on' if cuda_graphs else 'off'}"
    return f"cpu threads={torch.get_num_threads()}"


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
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto: servelm's and the HF baseline's")
    ap.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="servelm replays decoding steps as CUDA graphs on CUDA (default: %(default)s)",
    )
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--quantization", default="none", choices=QUANTIZATIONS, help="servelm's (default: %(default)s)")
    ap.add_argument("--against", choices=QUANTIZATIONS, help="also run servelm with this quantization, alternating")
    ap.add_argument(
        "--against-dtype", help="also run servelm in this dtype (with --against's quantization, if given), alternating"
    )
    ap.add_argument("--no-hf", action="store_true", help="leave out the HF baseline")
    ap.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="servelm prefills every prompt on every run (by default runs after the first find them cached)",
    )
    args = ap.parse_args()

    from servelm import LLM, SamplingParams

    def engine(quantization: str, dtype: str) -> LLM:
        return LLM(
            args.model,
            dtype=dtype,
            device=args.device,
            cuda_graphs=args.cuda_graphs,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory=2 << 30,
            quantization=quantization,
            enable_prefix_caching=not args.no_prefix_caching,
        )

    llm = engine(args.quantization, args.dtype)
    dtype = llm.engine.runner.dtype  # what --dtype (auto included) resolved to
    device = llm.engine.runner.device
    vocab = llm.engine.runner.model_config.vocab_size
    prompts = _prompts(vocab, args.num_prompts, args.input_len, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    n_out = args.num_prompts * args.output_len
    if args.against or args.against_dtype:
        other = engine(args.against or args.quantization, args.against_dtype or args.dtype)
        _compare(llm, other, args, prompts, params)
    elif args.no_hf:
        _compare(llm, None, args, prompts, params)
    if args.no_hf:
        return

    from transformers import AutoModelForCausalLM

    from servelm.engine.device import resolve_dtype
    from servelm.models.registry import resolve_model_path

    hf_dtype = resolve_dtype(args.hf_dtype, device) if args.hf_dtype else dtype
    path = resolve_model_path(args.model)
    if path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=hf_dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=hf_dtype)
    hf.to(device).eval()

    def hf_generate(batch: list[list[int]]) -> None:
        ids = torch.tensor(batch, device=device)
        with torch.no_grad():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
                pad_token_id=0,
            ).tolist()  # waits for the GPU, where there is one

    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    servelm_rate = _median_rate(lambda: llm.generate(prompts, params), n_out, args.repeats)
    servelm_b1 = _median_rate(lambda: llm.generate(prompts[:1], params), args.output_len, args.repeats)
    hf_generate(prompts[:1])  # warm-up
    hf_b1 = _median_rate(lambda: hf_generate(prompts[:1]), args.output_len, args.repeats)
    single = prompts[: args.hf_single]
    hf_single = _median_rate(lambda: [hf_generate([p]) for p in single], len(single) * args.output_len, args.repeats)
    hf_batched = _median_rate(lambda: hf_generate(prompts), n_out, args.repeats)

    print(
        f"model {args.model}, servelm {dtype} (quantization {args.quantization}), HF {hf_dtype}, {_where(device, args.cuda_graphs)}"
    )
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


def _label(llm) -> str:
    runner = llm.engine.runner
    return f"servelm, {str(runner.dtype).removeprefix('torch.')}, quantization {runner.config.quantization}"


def _compare(llm, other, args, prompts, params) -> None:
    """servelm with --dtype and --quantization against servelm with --against-dtype and --against (or alone,
    ``other`` None), batched and batch 1, runs alternating."""
    warm = type(params)(temperature=0.0, max_tokens=4)
    engines = (llm, other) if other is not None else (llm,)
    for engine in engines:
        engine.generate(prompts[:2], warm)
    n_out = args.num_prompts * args.output_len
    batched = _interleaved_rates([lambda e=e: e.generate(prompts, params) for e in engines], n_out, args.repeats)
    one = _interleaved_rates(
        [lambda e=e: e.generate(prompts[:1], params) for e in engines], args.output_len, args.repeats
    )
    print(
        f"model {args.model}, {args.num_prompts} requests x {args.input_len} prompt + "
        f"{args.output_len} output tokens, median of {args.repeats} alternating runs, "
        f"{_where(llm.engine.runner.device, args.cuda_graphs)}"
    )
    print(f"{'output tok/s':>44s}{'all batched':>14s}{'batch 1':>10s}")
    for engine, b, o in zip(engines, batched, one):
        print(f"{_label(engine):44s}{b:14.1f}{o:10.1f}")
    if other is not None:
        print(
            f"ratio {_label(other)} / {_label(llm)}: {batched[1] / batched[0]:.2f}x batched, "
            f"{one[1] / one[0]:.2f}x batch 1"
        )


if __name__ == "__main__":
    main()
