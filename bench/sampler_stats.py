"""The sampler's passes over the logits: ``log_softmax`` against the native ``log_softmax_stats``, and the
whole ``Sampler`` call, greedy and sampled, with the kernels and with the PyTorch fallback, in one run.

Each sampled token's raw logprob (and the top logprobs a request asks for)
comes from the log-softmax of its row. The sampler used to write that whole
``[rows, vocab]`` tensor (``torch.log_softmax``) and then search the row's
largest value for a greedy token (``row_blocks.row_max``); the native
kernel makes one pass per row that gives the largest value, its index and
the logsum, from which any logprob is ``x - largest - logsum``. A sampled
row's random draw is the native ``draw``: the row's weights summed in
blocks, the block the uniform number falls in searched, top-p's cutoff found
from bucket sums of the weights' bits, against PyTorch's division, softmax,
``topk`` of 1024 candidates for top-p and two-level inverse transform. This times, on random logits of the default models'
vocabulary sizes (SmolLM2's 49152, Qwen2.5's 151936) for 1 and 32 rows: the
two passes, then the whole ``Sampler`` call, greedy, at temperature 0.8, and
at 0.8 with top_p 0.95, with the kernels and with the PyTorch fallback (the kernels turned off).
Then the repetition, frequency and presence penalties of 32 rows (300 prompt
and 100 output tokens each) applied as ``apply_penalties_`` applies them,
to the tokens seen only, against the dense formulas over the whole
vocabulary (counts scattered into ``[rows, vocab]``, as the sampler did
before). Last, a request's top logprobs (k = 5 and 20 of 32 rows): the native
``top_values`` against ``x[rows].topk(k)``. Medians of --repeats calls, alternating; glibc's freed memory kept, as the
engine keeps it (``platform.memory.keep_freed_memory``: without it each
``[rows, vocab]`` PyTorch result faults in fresh pages, several times the
PyTorch path's time).

    .venv/bin/python bench/sampler_stats.py
"""

from __future__ import annotations

import argparse
from functools import partial
from unittest import mock

import torch
from gemm import _median_ms

from servelm import kernels
from servelm.engine.logits_processors import apply_penalties_
from servelm.engine.row_blocks import row_max
from servelm.engine.sampler import Sampler, SamplingState
from servelm.engine.sampling_params import SamplingParams
from servelm.platform.memory import keep_freed_memory


def by_log_softmax(logits: torch.Tensor) -> None:
    torch.log_softmax(logits, dim=-1)
    row_max(logits)


def sampler_call(logits: torch.Tensor, states: list[SamplingState], native: bool) -> None:
    if native:
        Sampler()(logits, states)
        return
    with mock.patch.object(kernels, "for_tensors", lambda *tensors: None):
        Sampler()(logits, states)


def dense_penalties(logits: torch.Tensor, prompt: list[list[int]], output: list[list[int]]) -> torch.Tensor:
    """Repetition 1.1, frequency 0.5 and presence 0.2 through counts over the whole vocabulary."""
    rows, vocab = logits.shape

    def counts(lists: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in lists)
        padded = torch.tensor([t + [vocab] * (width - len(t)) for t in lists])
        return torch.zeros(rows, vocab + 1).scatter_add_(1, padded, torch.ones(padded.shape))[:, :vocab]

    out = counts(output)
    seen = (counts(prompt) + out) > 0
    x = torch.where(seen, torch.where(logits > 0, logits / 1.1, logits * 1.1), logits)
    return x - 0.5 * out - 0.2 * (out > 0)


def sparse_penalties(logits: torch.Tensor, prompt: list[list[int]], output: list[list[int]]) -> torch.Tensor:
    x = logits.clone()  # as apply_logits_processors does
    n = len(prompt)
    apply_penalties_(x, list(range(n)), prompt, output, [1.1] * n, [0.5] * n, [0.2] * n)
    return x


def torch_top_values(logits: torch.Tensor, rows: torch.Tensor, k: int) -> None:
    logits[rows].topk(k, dim=-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    keep_freed_memory()
    native = kernels.cpu_kernels()
    if native is None:
        raise SystemExit("servelm's CPU kernels are not available here")
    print(f"threads={torch.get_num_threads()}, milliseconds per call (median of {args.repeats})")
    print(
        f"{'vocab':>7s}{'rows':>6s}{'log_softmax+max':>17s}{'stats':>8s}{'ratio':>8s}"
        f"{'greedy, torch':>15s}{'native':>8s}{'ratio':>8s}{'T=0.8, torch':>14s}{'native':>8s}{'ratio':>8s}"
        f"{'top-p, torch':>14s}{'native':>8s}{'ratio':>8s}"
    )
    gen = torch.Generator().manual_seed(0)
    for vocab in (49152, 151936):
        for rows in (1, 32):
            logits = torch.randn(rows, vocab, generator=gen) * 4
            greedy, sampled, top_p = (
                [SamplingState(params, [1, 2], 2, None, set()) for _ in range(rows)]
                for params in (
                    SamplingParams(temperature=0.0),
                    SamplingParams(temperature=0.8),
                    SamplingParams(temperature=0.8, top_p=0.95),
                )
            )
            pairs = []
            for _ in range(3):  # alternating rounds, the machine's load shared
                pairs.append(
                    (
                        _median_ms(partial(by_log_softmax, logits), args.repeats),
                        _median_ms(partial(native.log_softmax_stats, logits), args.repeats),
                        _median_ms(partial(sampler_call, logits, greedy, False), args.repeats),
                        _median_ms(partial(sampler_call, logits, greedy, True), args.repeats),
                        _median_ms(partial(sampler_call, logits, sampled, False), args.repeats),
                        _median_ms(partial(sampler_call, logits, sampled, True), args.repeats),
                        _median_ms(partial(sampler_call, logits, top_p, False), args.repeats),
                        _median_ms(partial(sampler_call, logits, top_p, True), args.repeats),
                    )
                )
            old, new, greedy_old, greedy_new, sampled_old, sampled_new, top_p_old, top_p_new = (
                sorted(col)[1] for col in zip(*pairs)
            )
            print(
                f"{vocab:7d}{rows:6d}{old:17.2f}{new:8.2f}{old / new:7.2f}x"
                f"{greedy_old:15.2f}{greedy_new:8.2f}{greedy_old / greedy_new:7.2f}x"
                f"{sampled_old:14.2f}{sampled_new:8.2f}{sampled_old / sampled_new:7.2f}x"
                f"{top_p_old:14.2f}{top_p_new:8.2f}{top_p_old / top_p_new:7.2f}x"
            )
    print(f"\n{'vocab':>7s}{'rows':>6s}{'penalties, dense':>18s}{'seen only':>11s}{'ratio':>8s}")
    for vocab in (49152, 151936):
        logits = torch.randn(32, vocab, generator=gen) * 4
        prompt = [torch.randint(0, vocab, (300,), generator=gen).tolist() for _ in range(32)]
        output = [torch.randint(0, vocab, (100,), generator=gen).tolist() for _ in range(32)]
        assert torch.equal(dense_penalties(logits, prompt, output), sparse_penalties(logits, prompt, output))
        pairs = [
            (
                _median_ms(partial(dense_penalties, logits, prompt, output), args.repeats),
                _median_ms(partial(sparse_penalties, logits, prompt, output), args.repeats),
            )
            for _ in range(3)
        ]
        dense, sparse = (sorted(col)[1] for col in zip(*pairs))
        print(f"{vocab:7d}{32:6d}{dense:18.2f}{sparse:11.2f}{dense / sparse:7.2f}x")
    print(f"\n{'vocab':>7s}{'rows':>6s}{'k':>4s}{'topk':>8s}{'top_values':>12s}{'ratio':>8s}")
    for vocab in (49152, 151936):
        logits = torch.randn(32, vocab, generator=gen) * 4
        rows = torch.arange(32)
        for k in (5, 20):
            assert torch.equal(native.top_values(logits, rows, k)[0], logits[rows].topk(k).values)
            pairs = [
                (
                    _median_ms(partial(torch_top_values, logits, rows, k), args.repeats),
                    _median_ms(partial(native.top_values, logits, rows, k), args.repeats),
                )
                for _ in range(3)
            ]
            old, new = (sorted(col)[1] for col in zip(*pairs))
            print(f"{vocab:7d}{32:6d}{k:4d}{old:8.2f}{new:12.2f}{old / new:7.2f}x")


if __name__ == "__main__":
    main()
