"""Top-p's cutoff over a whole row: a sort against ``row_blocks.mass_threshold``'s bucket sums, in one run.

The sampler first looks for the nucleus among each row's 1024 most likely
tokens (cheap: a ``topk`` and a running sum); a flatter row, whose nucleus
goes on past them, needs the cutoff over the whole vocabulary. This times,
on random logits of the vocabulary sizes of the default models (SmolLM2's
49152, Qwen2.5's 151936), for 1 and 32 rows: a descending sort with a
running sum (what the sampler did before), ``mass_threshold``, and
``apply_top_p`` as a whole. Medians of --repeats calls. The last column
counts the rows whose two cutoffs differ: both sum in float32, over a
different order, so a token at the boundary can fall either way (against a
float64 sort, each differs in about 2% of such rows).

    .venv/bin/python bench/sampler_top_p.py
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from gemm import _median_ms

from servelm.engine.row_blocks import mass_threshold
from servelm.engine.sampler import _nucleus_cutoff, apply_top_p


def sorted_cutoff(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The cutoff as the sampler found it before ``mass_threshold``: over the whole row, sorted."""
    return _nucleus_cutoff(probs.sort(dim=-1, descending=True).values, p)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    print(f"top_p {args.top_p}, threads={torch.get_num_threads()}, milliseconds per call (median of {args.repeats})")
    print(
        f"{'vocab':>7s}{'rows':>6s}{'logits':>10s}{'sort':>9s}{'buckets':>9s}{'ratio':>8s}{'apply_top_p':>13s}"
        f"{'rows differing':>16s}"
    )
    gen = torch.Generator().manual_seed(0)
    for vocab in (49152, 151936):
        for rows in (1, 32):
            # logits ~ N(0, 0.5): the nucleus spans most of the vocabulary; N(0, 2): tens of thousands of tokens
            for scale in (0.5, 2.0):
                logits = torch.randn(rows, vocab, generator=gen) * scale
                probs = logits.softmax(dim=-1)
                p = torch.full((rows, 1), args.top_p)
                differing = (sorted_cutoff(probs, p) != mass_threshold(probs, p)).sum().item()
                by_sort = _median_ms(partial(sorted_cutoff, probs, p), args.repeats)
                by_buckets = _median_ms(partial(mass_threshold, probs, p), args.repeats)
                whole = _median_ms(partial(apply_top_p, logits, [args.top_p] * rows), args.repeats)
                print(
                    f"{vocab:7d}{rows:6d}{f'N(0,{scale:g})':>10s}{by_sort:9.2f}{by_buckets:9.2f}"
                    f"{by_sort / by_buckets:7.1f}x{whole:13.2f}{differing:16d}"
                )


if __name__ == "__main__":
    main()
