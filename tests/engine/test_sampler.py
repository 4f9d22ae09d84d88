"""The sampler on small hand-made logits: processing order, truncation, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from servelm.engine.logits_processors import apply_logits_processors, apply_penalties_
from servelm.engine.row_blocks import BLOCK, mass_threshold
from servelm.engine.sampler import (
    Sampler,
    SamplingState,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_generator,
    random_choice,
    sampling_probs,
)
from servelm.engine.sampling_params import SamplingParams

from .token_masks import FixedTokenMask

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def state(params: SamplingParams | None = None, *, prompt=(), output=(), eos=(), seed=None, device="cpu", mask=None):
    params = params or SamplingParams()
    return SamplingState(
        params=params,
        token_ids=list(prompt) + list(output),
        num_prompt_tokens=len(prompt),
        generator=make_generator(seed, device),
        eos_token_ids=set(eos),
        grammar=None if mask is None else FixedTokenMask(mask),
    )


def draws(logits_row: torch.Tensor, params: SamplingParams, n: int, device="cpu") -> list[int]:
    """``n`` unseeded samples of one row, taken as one batch of ``n`` identical rows."""
    logits = logits_row.to(device).expand(n, -1).contiguous()
    return Sampler()(logits, [state(params) for _ in range(n)]).token_ids


# Probabilities 0.5, 0.3, 0.15, 0.05 at shuffled positions, so order is not index order.
PROBS = torch.tensor([0.15, 0.5, 0.05, 0.3])
LOGITS = PROBS.log()


@pytest.fixture(autouse=True)
def _seed_global_rng():
    torch.manual_seed(1234)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device):
    logits = torch.randn(8, 50, device=device)
    out = Sampler()(logits, [state(SamplingParams(temperature=0.0)) for _ in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("vocab", [50, BLOCK, 3 * BLOCK + 5])
def test_greedy_takes_the_first_of_tied_maxima_across_blocks(vocab):
    # Small integers tie often, within a block and across blocks (the two-level lookup's seams); one row
    # holds its maximum only in the partial last block, one only in column 0.
    logits = torch.randint(-3, 4, (6, vocab)).float()
    logits[4, :] = -5.0
    logits[4, -1] = 9.0
    logits[5, :] = -5.0
    logits[5, 0] = 9.0
    out = Sampler()(logits, [state(SamplingParams(temperature=0.0)) for _ in range(6)])
    first_of_largest = (logits == logits.amax(-1, keepdim=True)).int().argmax(-1)
    assert out.token_ids == first_of_largest.tolist()


def test_top_k_1_is_deterministic_argmax():
    logits = torch.randn(6, 30)
    params = SamplingParams(temperature=1.5, top_k=1)
    for _ in range(3):
        assert Sampler()(logits, [state(params) for _ in range(6)]).token_ids == logits.argmax(-1).tolist()


def test_greedy_rows_stay_argmax_among_random_rows():
    logits = torch.randn(6, 30)
    greedy, rand = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    states = [state(greedy if i % 2 == 0 else rand) for i in range(6)]
    out = Sampler()(logits, states)
    assert out.token_ids[::2] == logits.argmax(-1).tolist()[::2]


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(top_k=2), {1, 3}),
        (SamplingParams(top_k=3), {0, 1, 3}),
        (SamplingParams(top_p=0.75), {1, 3}),
        (SamplingParams(top_p=0.85), {0, 1, 3}),
        (SamplingParams(top_p=0.4), {1}),
        (SamplingParams(min_p=0.2), {0, 1, 3}),  # threshold 0.1
        (SamplingParams(min_p=0.5), {1, 3}),  # threshold 0.25
        (SamplingParams(top_k=3, top_p=0.75, min_p=0.0), {1, 3}),
        (SamplingParams(top_k=3, min_p=0.6, temperature=2.0), {1, 3}),
    ],
)
def test_truncation_never_samples_outside_allowed_set(params, allowed):
    got = set(draws(LOGITS, params, 3000))
    assert got == allowed  # never outside, and with 3000 draws every allowed token shows up


def test_truncation_is_per_row_in_a_mixed_batch():
    rows = [
        (SamplingParams(top_k=2), {1, 3}),
        (SamplingParams(top_p=0.85), {0, 1, 3}),
        (SamplingParams(min_p=0.5), {1, 3}),
        (SamplingParams(), {0, 1, 2, 3}),
        (SamplingParams(temperature=0.0), {1}),
    ]
    reps = 600
    states = [state(p) for p, _ in rows for _ in range(reps)]
    out = Sampler()(LOGITS.expand(len(states), -1).contiguous(), states).token_ids
    for j, (_, allowed) in enumerate(rows):
        assert set(out[j * reps : (j + 1) * reps]) == allowed


def _reference_kept(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Top-k, then top-p over what is left (renormalised), then min-p, one token at a time."""
    probs = torch.softmax(row.double(), dim=-1)
    order = probs.argsort(descending=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    total = probs[order].sum().item()
    kept, mass = [], 0.0
    for tok in order:
        if mass >= top_p:
            break
        kept.append(tok)
        mass += probs[tok].item() / total
    return {t for t in kept if probs[t] >= min_p * probs[order[0]]}


def test_truncation_functions_match_a_plain_reference():
    gen = torch.Generator().manual_seed(3)
    # Rows from peaky to flat over a vocabulary wider than top-p's candidate list.
    logits = torch.randn(6, 3000, generator=gen) * torch.tensor([8.0, 4.0, 2.0, 1.0, 0.5, 0.1])[:, None]
    cases = [(0, 0.9, 0.0), (0, 0.5, 0.0), (0, 0.99, 0.0), (40, 1.0, 0.0), (0, 1.0, 0.05), (300, 0.8, 0.01)]
    for top_k, top_p, min_p in cases:
        x = logits
        if top_k:
            x = apply_top_k(x, [top_k] * 6)
        if top_p < 1.0:
            x = apply_top_p(x, [top_p] * 6)
        if min_p:
            x = apply_min_p(x, [min_p] * 6)
        for r in range(6):
            got = set(torch.isfinite(x[r]).nonzero()[:, 0].tolist())
            assert got == _reference_kept(logits[r], top_k, top_p, min_p), (r, top_k, top_p, min_p)


def test_the_top_p_cutoff_found_from_bucket_sums_is_the_one_a_sort_finds():
    gen = torch.Generator().manual_seed(5)
    # flat to peaky rows, one with zero probabilities, one whose every value comes twice (ties at the cutoff)
    logits = torch.randn(6, 5000, generator=gen) * torch.tensor([0.05, 0.3, 1.0, 3.0, 0.3, 1.0])[:, None]
    logits[4, ::7] = float("-inf")
    logits[5, :2500] = logits[5, 2500:]
    probs = logits.softmax(dim=-1)
    descending = probs.double().sort(dim=-1, descending=True).values
    mass_before = descending.cumsum(dim=-1) - descending
    for p in (0.05, 0.5, 0.9, 0.999):
        kept = (mass_before < p).sum(dim=-1, keepdim=True)
        assert torch.equal(mass_threshold(probs, torch.full((6, 1), p)), descending.gather(1, kept - 1).float()), p
    # a p beyond the row's total (rounding) keeps everything
    assert (mass_threshold(probs, torch.full((6, 1), 1.5)) <= probs.amin(dim=-1, keepdim=True)).all()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_follow_softmax_over_temperature(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    n = 20000
    counts = torch.bincount(torch.tensor(draws(logits, SamplingParams(temperature=temperature), n)), minlength=5)
    expected = torch.softmax(logits / temperature, dim=-1)
    # Chi-square with 4 degrees of freedom: 25 is far beyond the 0.9999 quantile (23.5).
    chi2 = (((counts - n * expected) ** 2) / (n * expected)).sum().item()
    assert chi2 < 25, (counts, expected * n)


def test_frequencies_after_top_p_are_renormalised():
    n = 20000
    counts = torch.bincount(torch.tensor(draws(LOGITS, SamplingParams(top_p=0.75), n)), minlength=4)
    assert counts[1] / n == pytest.approx(0.5 / 0.8, abs=0.02)
    assert counts[3] / n == pytest.approx(0.3 / 0.8, abs=0.02)


def test_logit_bias_bans_and_forces():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]] * 2)
    greedy_ban = SamplingParams(temperature=0.0, logit_bias={1: -100})
    random_force = SamplingParams(temperature=1.0, logit_bias={2: 100, 99_999: 5})  # unknown ids ignored
    for _ in range(20):
        out = Sampler()(logits, [state(greedy_ban), state(random_force)])
        assert out.token_ids == [3, 2]


def test_a_whole_vocabulary_logit_bias_adds_up_and_is_read_once_per_sequence():
    gen = torch.Generator().manual_seed(0)
    vocab = 1000
    logits = torch.randn(3, vocab, generator=gen)
    bias = torch.randint(-100, 101, (vocab,), generator=gen).float()
    params = SamplingParams(temperature=0.0, logit_bias={t: float(v) for t, v in enumerate(bias.tolist())})
    rows = [state(params), state(), state(SamplingParams(logit_bias={7: 3.0, 5000: 1.0}))]
    out = apply_logits_processors(logits, rows)
    assert torch.equal(out[0], logits[0] + bias)
    assert torch.equal(out[1], logits[1])
    assert torch.equal(out[2], logits[2] + 3.0 * (torch.arange(vocab) == 7))
    first = rows[0].logit_bias(vocab, logits.device)
    apply_logits_processors(logits, rows)  # a later step: the dict is not walked again
    assert rows[0].logit_bias(vocab, logits.device) is first


def test_the_min_tokens_ban_covers_every_stop_token_and_is_made_once_per_sequence():
    vocab = 1000
    logits = torch.zeros(2, vocab)
    params = SamplingParams(min_tokens=3, max_tokens=5, stop_token_ids=[*range(0, vocab, 2), 5000])
    rows = [state(params, eos={1}), state(params, output=[7, 7, 7], eos={1})]
    out = apply_logits_processors(logits, rows)
    banned = torch.isinf(out[0]).nonzero().flatten().tolist()
    assert banned == sorted([1, *range(0, vocab, 2)])
    assert not torch.isinf(out[1]).any()  # min_tokens reached: nothing banned
    first = rows[0].min_tokens_ban(vocab, logits.device)
    apply_logits_processors(logits, rows)
    assert rows[0].min_tokens_ban(vocab, logits.device) is first


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    assert Sampler()(logits, [state(params, output=[], eos={1})]).token_ids == [3]
    assert Sampler()(logits, [state(params, output=[3], eos={1})]).token_ids == [3]
    assert Sampler()(logits, [state(params, output=[3, 3], eos={1})]).token_ids == [1]


def test_allowed_token_mask_is_respected():
    mask = torch.tensor([True, False, True, False])
    out = Sampler()(LOGITS.expand(500, -1).contiguous(), [state(mask=mask) for _ in range(500)])
    assert set(out.token_ids) == {0, 2}


def test_penalties_follow_the_formulas_exactly():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 4.0], [9.0] * 5, [1.0, 1.0, 1.0, 1.0, 1.0]])
    prompt = [[3], [0]]
    output = [[0, 0, 2], [1, 1, 1, 4, 7]]  # 7: beyond this vocabulary (a draft model's), ignored
    rep, freq, pres = [2.0, 1.0], [0.5, -0.25], [1.0, 0.75]
    got = logits.clone()
    apply_penalties_(got, [0, 2], prompt, output, rep, freq, pres)

    expected = logits.tolist()
    for r, row in enumerate([0, 2]):
        seen = set(prompt[r]) | set(output[r])
        for t in range(5):
            x = expected[row][t]
            if t in seen:
                x = x / rep[r] if x > 0 else x * rep[r]
            count = output[r].count(t)
            expected[row][t] = x - freq[r] * count - pres[r] * (count > 0)
    # Row 0: token 0 seen twice in output: 2/2 - 0.5*2 - 1 = -1; token 3 in prompt only: -3*2 = -6.
    assert expected[0] == [-1.0, -1.0, 0.25 - 0.5 - 1.0, -6.0, 4.0]
    assert expected[1] == [9.0] * 5  # a row not named is left alone
    assert torch.equal(got, torch.tensor(expected))


def test_penalties_over_a_real_vocabulary_match_the_dense_formulas():
    # Long prompts and outputs with repeats, every penalty at once, against counts over the whole vocabulary.
    vocab, rows = 49152, 8
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab, generator=generator) * 4
    prompt = [torch.randint(0, vocab, (300,), generator=generator).tolist() for _ in range(rows)]
    output = [torch.randint(0, 50, (n,), generator=generator).tolist() for n in range(0, 8 * rows, 8)]
    rep = [1.0 + 0.05 * r for r in range(rows)]
    freq = [0.1 * (r % 3) for r in range(rows)]
    pres = [0.2 * (r % 2) - 0.1 for r in range(rows)]
    got = logits.clone()
    apply_penalties_(got, list(range(rows)), prompt, output, rep, freq, pres)

    def counts(lists):
        c = torch.zeros(rows, vocab)
        for r, ids in enumerate(lists):
            for t in ids:
                c[r, t] += 1
        return c

    out_counts = counts(output)
    seen = (counts(prompt) + out_counts) > 0
    r = torch.tensor(rep)[:, None]
    expected = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    expected = expected - torch.tensor(freq)[:, None] * out_counts - torch.tensor(pres)[:, None] * (out_counts > 0)
    assert torch.equal(got, expected)


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    plain = SamplingParams(temperature=0.0)
    assert Sampler()(logits, [state(plain, output=[0, 0])]).token_ids == [0]
    for params in (
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, frequency_penalty=0.1),
        SamplingParams(temperature=0.0, presence_penalty=0.2),
    ):
        assert Sampler()(logits, [state(params, output=[0, 0])]).token_ids == [1]
    rep_prompt = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    assert Sampler()(logits, [state(rep_prompt, prompt=[0])]).token_ids == [1]
    # frequency/presence ignore the prompt (OpenAI semantics)
    freq_prompt = SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0)
    assert Sampler()(logits, [state(freq_prompt, prompt=[0])]).token_ids == [0]


def _seeded_run(seed: int, steps: int, neighbours: int, position: int, device="cpu") -> list[int]:
    """Tokens drawn by one seeded row, with ``neighbours`` other random rows in its batch."""
    vocab = 2000  # wide and flat enough that top-p must sort whole rows, unlike its peaky neighbours
    logits_gen = torch.Generator().manual_seed(99)  # the same logits whatever the batch
    target = state(SamplingParams(temperature=0.9, top_p=0.95), seed=seed, device=device)
    others = [
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0.7, min_p=0.1, presence_penalty=0.5),
        SamplingParams(temperature=0.0),
        SamplingParams(),
    ]
    tokens = []
    for _ in range(steps):
        target_logits = torch.randn(1, vocab, generator=logits_gen)
        batch = [
            state(others[i % len(others)], output=[1, 2], seed=(7 if i == 1 else None), device=device)
            for i in range(neighbours)
        ]
        batch.insert(position, target)
        logits = torch.randn(len(batch), vocab) * 6
        logits[position] = target_logits[0]
        tok = Sampler()(logits.to(device), batch).token_ids[position]
        target.token_ids.append(tok)
        tokens.append(tok)
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_is_independent_of_its_batch(device):
    alone = _seeded_run(seed=42, steps=30, neighbours=0, position=0, device=device)
    assert _seeded_run(seed=42, steps=30, neighbours=5, position=3, device=device) == alone
    assert _seeded_run(seed=42, steps=30, neighbours=9, position=9, device=device) == alone
    assert _seeded_run(seed=43, steps=30, neighbours=0, position=0, device=device) != alone


def test_same_seed_same_tokens_across_calls():
    logits = torch.randn(1, 1000)
    params = SamplingParams(temperature=1.0)
    a, b = state(params, seed=5), state(params, seed=5)
    seq_a = [Sampler()(logits, [a]).token_ids[0] for _ in range(20)]
    seq_b = [Sampler()(logits, [b]).token_ids[0] for _ in range(20)]
    assert seq_a == seq_b
    assert len(set(seq_a)) > 1  # the generator advances between calls


def test_make_generator():
    assert make_generator(None, "cpu") is None
    for seed in (0, -1, 2**70):  # any integer a client sends is accepted
        assert isinstance(make_generator(seed, "cpu"), torch.Generator)


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax(device):
    logits = torch.randn(3, 40, device=device)
    states = [
        state(SamplingParams(temperature=0.3, logit_bias={5: 50.0}, logprobs=4)),
        state(SamplingParams(temperature=0.0, repetition_penalty=1.5), output=[2, 3]),
        state(SamplingParams(logprobs=0)),
    ]
    out = Sampler()(logits, states)
    raw = torch.log_softmax(logits.float(), dim=-1).cpu()
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw[i, tok].item(), abs=1e-5)
    assert out.token_ids[0] == 5  # the bias steered the choice but not the reported logprob

    top = out.top_logprobs
    assert top is not None and top[1] is None and top[2] == []
    assert len(top[0]) == 4
    values = [v for _, v in top[0]]
    assert values == sorted(values, reverse=True)
    ref_vals, ref_ids = raw[0].topk(4)
    assert [t for t, _ in top[0]] == ref_ids.tolist()
    assert values == pytest.approx(ref_vals.tolist(), abs=1e-5)


def test_the_native_pass_over_the_logits_gives_what_pytorch_gives(monkeypatch):
    # The CPU kernel's one pass (largest, index, logsum) against the PyTorch fallback, on a real vocabulary
    # width, with a row whose logits are all NaN and one banned but for its grammar's token.
    from servelm import kernels

    logits = torch.randn(5, 49152).mul(4)
    logits[3] = float("nan")
    mask = torch.zeros(49152, dtype=torch.bool)
    mask[7] = True

    def sample():
        states = [
            state(SamplingParams(temperature=0.0)),
            state(SamplingParams(temperature=0.0, logprobs=5)),
            state(SamplingParams(temperature=0.8, top_p=0.9, logprobs=2), seed=3),
            state(SamplingParams(temperature=0.0, logprobs=1)),
            state(SamplingParams(temperature=0.0, logit_bias={7: -100.0}), mask=mask),
        ]
        return Sampler()(logits.clone(), states)

    assert kernels.for_tensors(logits) is not None  # the first run is the kernel's
    native = sample()
    monkeypatch.setattr(kernels, "for_tensors", lambda *tensors: None)
    fallback = sample()
    assert native.token_ids == fallback.token_ids
    assert native.token_ids[4] == 7  # the grammar's only token, however biased
    assert math.isnan(native.logprobs[3]) and math.isnan(fallback.logprobs[3])
    # float32 sums of 49152 terms in another order: a few ulps of the logsum apart
    assert native.logprobs[:3] + native.logprobs[4:] == pytest.approx(
        fallback.logprobs[:3] + fallback.logprobs[4:], abs=1e-5
    )
    for mine, theirs in zip(native.top_logprobs, fallback.top_logprobs):
        assert (mine is None) == (theirs is None)
        if mine is not None and not any(math.isnan(v) for _, v in mine):
            assert [t for t, _ in mine] == [t for t, _ in theirs]
            assert [v for _, v in mine] == pytest.approx([v for _, v in theirs], abs=1e-5)
    raw = torch.log_softmax(logits, dim=-1)
    assert native.logprobs[1] == pytest.approx(raw[1].max().item(), abs=1e-5)  # greedy: the top raw logprob


def test_when_every_row_is_sampled_the_draw_gives_the_logprobs_too(monkeypatch):
    # No greedy row, no processor: the kernel's draw also gives each row's largest logit and logsum (one pass
    # over the row), and log_softmax_stats is not called, unless a row has nothing to draw from. The tokens
    # are the seeded ones the PyTorch fallback draws; the logprobs, the raw log-softmax's.
    from servelm import kernels
    from servelm.engine import sampler as sampler_mod

    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(2)).mul(4)
    logits[1, 100:] = float("-inf")
    settings = [{}, {"temperature": 0.7}, {"temperature": 1.3, "top_p": 0.9}, {"top_k": 20}, {"min_p": 0.05}, {}]

    def sample(rows):
        states = [state(SamplingParams(**settings[i], logprobs=3), seed=10 + i) for i in range(rows.shape[0])]
        return Sampler()(rows.clone(), states)

    assert kernels.for_tensors(logits) is not None
    stats = sampler_mod.log_softmax_stats
    monkeypatch.setattr(sampler_mod, "log_softmax_stats", lambda x: pytest.fail("a second pass over the logits"))
    native = sample(logits)
    broken = logits.clone()
    broken[5] = float("nan")  # no distribution: the usual stats after all, and a greedy fallback
    monkeypatch.setattr(sampler_mod, "log_softmax_stats", stats)
    native_broken = sample(broken)
    monkeypatch.setattr(kernels, "for_tensors", lambda *tensors: None)
    fallback, fallback_broken = sample(logits), sample(broken)
    assert native.token_ids == fallback.token_ids
    assert native.logprobs == pytest.approx(fallback.logprobs, abs=1e-5)
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert native.logprobs == pytest.approx([raw[r, t].item() for r, t in enumerate(native.token_ids)], abs=1e-5)
    for mine, theirs in zip(native.top_logprobs, fallback.top_logprobs):
        assert [t for t, _ in mine] == [t for t, _ in theirs]
        assert [v for _, v in mine] == pytest.approx([v for _, v in theirs], abs=1e-5)
    assert native_broken.token_ids[:5] == native.token_ids[:5] == fallback_broken.token_ids[:5]
    assert 0 <= native_broken.token_ids[5] < 49152 and math.isnan(native_broken.logprobs[5])
    assert native_broken.logprobs[:5] == pytest.approx(native.logprobs[:5], abs=1e-5)


def _native_draw(logits, params, u):
    from servelm import kernels

    native = kernels.for_tensors(logits)
    assert native is not None
    return native.draw(
        logits,
        torch.tensor([1.0 / p.temperature for p in params]),
        torch.tensor([p.top_k for p in params]),
        torch.tensor([p.top_p for p in params]),
        torch.tensor([p.min_p for p in params]),
        u,
    )


def _assert_row_stats(logits, drawn):
    """The draw's largest value and logsum of every row: as ``log_softmax_stats`` gives them (NaN logsum where
    the largest is not finite)."""
    _, largest, logsum = drawn
    top = logits.max(dim=-1).values
    finite = torch.isfinite(top)
    assert torch.equal(largest[finite], top[finite])
    assert torch.isnan(logsum[~finite]).all()
    expected = torch.logsumexp(logits[finite].double() - top[finite, None].double(), dim=-1)
    torch.testing.assert_close(logsum[finite].double(), expected, rtol=1e-6, atol=1e-6)


def _assert_drawn_from(tokens, probs, u):
    """Each row's token is the one whose interval of the running sum of ``probs`` holds ``u`` (up to float32
    rounding of sums over the row): the inverse transform, never a token of probability 0."""
    probs = probs.double()
    probs = probs / probs.sum(dim=-1, keepdim=True)
    after = probs.cumsum(dim=-1)
    for r, t in enumerate(tokens.tolist()):
        assert probs[r, t] > 0, r
        assert after[r, t] - probs[r, t] - 1e-5 <= u[r] <= after[r, t] + 1e-5, r


def test_the_native_draw_takes_the_token_whose_share_of_the_running_sum_holds_the_uniform_number():
    # No truncation: across block edges, a partial last block and several temperatures; banned tokens,
    # rows whose only token is the last; u at 0 and just below 1.
    vocab = 3 * BLOCK + 5
    rows = 400
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    banned = torch.rand(rows, vocab, generator=generator) < 0.3
    banned[:, [0, BLOCK - 1, BLOCK, vocab - 1]] = True  # edges of blocks, the row's first and last
    logits[banned] = float("-inf")
    logits[7, :] = float("-inf")
    logits[7, vocab - 1] = 2.0  # the only token left is the last of the partial block
    logits[8, :-1] = float("-inf")
    logits[8, -1] = -1.0
    temperatures = [2.0, 1.0, 0.8, 0.25] * (rows // 4)
    params = [SamplingParams(temperature=t) for t in temperatures]
    u = torch.rand(rows, generator=generator)
    u[:4] = torch.tensor([0.0, 1.0 - 2**-24, 0.5, 0.999])
    drawn = _native_draw(logits, params, u)
    tokens = drawn[0]
    _assert_drawn_from(tokens, torch.softmax(logits.double() / torch.tensor(temperatures)[:, None], dim=-1), u)
    assert tokens[7] == vocab - 1 and tokens[8] == vocab - 1
    _assert_row_stats(logits, drawn)  # at temperature 1 the draw's own sums, else one more pass

    broken = torch.zeros(3, 40)
    broken[0, 5] = float("nan")
    broken[1, 9] = float("inf")
    broken[2] = float("-inf")
    drawn = _native_draw(broken, [SamplingParams()] * 3, torch.full((3,), 0.5))
    assert drawn[0].tolist() == [-1, -1, -1]
    assert torch.isnan(drawn[1][0]) and drawn[1][1] == float("inf") and drawn[1][2] == float("-inf")
    assert torch.isnan(drawn[2]).all()


@pytest.mark.parametrize(
    "truncation",
    [
        {"top_k": 5},
        {"top_k": 300},  # more than the kernel's heap on the stack holds
        {"top_p": 0.8},
        {"top_p": 0.999},
        {"min_p": 0.05},
        {"top_k": 40, "top_p": 0.9, "min_p": 0.01},
        {"top_k": 2000, "top_p": 0.95, "temperature": 1.7},
    ],
)
def test_the_native_draw_keeps_the_tokens_the_pytorch_stages_keep(truncation):
    # Rows peaky, flat and in between, with banned tokens; one whose top-p nucleus reaches into tokens of
    # under 2^-16 of the largest's weight, one of equal logits (top-p keeps the ties). The kernel's token
    # must come from the distribution sampling_probs (the PyTorch stages) makes, at u's place in it.
    vocab = 3 * BLOCK + 5
    rows = 96
    generator = torch.Generator().manual_seed(11)
    spread = torch.tensor([8.0, 3.0, 1.0, 0.1]).repeat(rows // 4)[:, None]
    logits = torch.randn(rows, vocab, generator=generator) * spread
    logits[torch.rand(rows, vocab, generator=generator) < 0.2] = float("-inf")
    logits[5] = -12.0 + 0.1 * torch.randn(vocab, generator=generator)
    logits[5, 17] = 0.0  # weights of the others about e^-12, under 2^-16 of its
    logits[6] = 1.5
    params = SamplingParams(**{"temperature": 0.7, **truncation})
    states = [state(params) for _ in range(rows)]
    probs, degenerate = sampling_probs(logits, states)
    assert not degenerate.any()
    u = torch.rand(rows, generator=generator)
    drawn = _native_draw(logits, [params] * rows, u)
    _assert_drawn_from(drawn[0], probs, u)
    _assert_row_stats(logits, drawn)


def test_the_native_top_values_are_the_rows_largest_in_order():
    # Against a stable reference (value descending, then index): ties within and across the heap's
    # cut, -inf, the heap beyond its stack size, k of 0 and of the whole row, a subset of the rows.
    from servelm import kernels

    generator = torch.Generator().manual_seed(2)
    x = torch.randint(-40, 40, (6, 3 * BLOCK + 5), generator=generator).float() / 4  # many ties
    x[2, 100:] = float("-inf")
    native = kernels.for_tensors(x)
    assert native is not None
    for k in (0, 1, 5, 20, 300, x.shape[1]):
        rows = torch.tensor([5, 0, 2, 2])
        values, ids = native.top_values(x, rows, k)
        for r, row in enumerate(rows.tolist()):
            order = sorted(range(x.shape[1]), key=lambda i: (-x[row, i].item(), i))[:k]
            assert ids[r].tolist() == order, (k, row)
            assert torch.equal(values[r], x[row, order])


@pytest.mark.parametrize("native", [True, False])
def test_a_row_with_no_distribution_falls_back_to_greedy_beside_drawn_rows(native, monkeypatch):
    from servelm import kernels

    if not native:
        monkeypatch.setattr(kernels, "for_tensors", lambda *tensors: None)
    logits = torch.randn(3, 2000)
    logits[1] = float("-inf")
    logits[1, 17] = float("inf")  # softmax of it is NaN: the row takes its greedy token
    out = Sampler()(logits, [state(SamplingParams(seed=1)), state(), state(SamplingParams(temperature=0.7))])
    assert out.token_ids[1] == 17
    assert all(0 <= t < 2000 for t in out.token_ids)


def test_top_logprobs_none_when_nobody_asks_and_k_clamped_to_vocab():
    logits = torch.randn(2, 6)
    assert Sampler()(logits, [state(), state()]).top_logprobs is None
    out = Sampler()(logits, [state(SamplingParams(logprobs=20)), state()])
    assert len(out.top_logprobs[0]) == 6 and out.top_logprobs[1] is None


def test_half_precision_logits_and_extreme_values():
    logits = torch.tensor([[1.0, 2.0, float("-inf"), 0.5]], dtype=torch.bfloat16)
    out = Sampler()(logits.expand(200, -1), [state(SamplingParams(temperature=1e-3)) for _ in range(200)])
    assert set(out.token_ids) == {1}
    out = Sampler()(logits.expand(500, -1), [state(SamplingParams(temperature=2.0)) for _ in range(500)])
    assert 2 not in out.token_ids and all(math.isfinite(v) for v in out.logprobs)


def test_rejects_mismatched_batch():
    with pytest.raises(ValueError):
        Sampler()(torch.randn(2, 5), [state()])


def test_random_choice_follows_the_probabilities_and_never_draws_a_zero():
    # Zero-probability tokens first, between and last: none may ever be drawn.
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
    n = 100_000
    draws = random_choice(probs.expand(n, -1).contiguous(), [None] * n)
    freq = torch.bincount(draws, minlength=6) / n
    assert freq[[0, 2, 5]].tolist() == [0.0, 0.0, 0.0]
    # 5 standard deviations of a binomial frequency at n = 100k is under 0.008.
    assert torch.allclose(freq[[1, 3, 4]], probs[[1, 3, 4]], atol=0.008)


def test_random_choice_across_blocks_follows_the_probabilities_and_never_draws_a_zero():
    # Three whole blocks of the two-level lookup and a partial one: mass on each side of block edges,
    # several tokens in one block, the partial block's first and last columns.
    block, vocab = BLOCK, 3 * BLOCK + 5
    probs = torch.zeros(vocab)
    where = [0, 5, block - 1, block, 2 * block + 7, 2 * block + 900, 3 * block, 3 * block + 4]
    probs[where] = torch.tensor([0.05, 0.05, 0.2, 0.1, 0.15, 0.05, 0.1, 0.3])
    n = 100_000
    draws = random_choice(probs.expand(n, -1).contiguous(), [None] * n)
    freq = torch.bincount(draws, minlength=vocab) / n
    assert set(draws.unique().tolist()) <= set(where)
    assert torch.allclose(freq[where], probs[where], atol=0.008)


def test_random_choice_with_all_mass_on_the_last_token():
    probs = torch.zeros(1000, 7)
    probs[:, 6] = 1.0
    assert random_choice(probs, [None] * 1000).tolist() == [6] * 1000


def test_a_stage_asked_by_some_rows_leaves_the_callers_logits_as_they_were():
    # float32 logits at temperature 1 with no processor reach the top-p stage as the caller's own tensor
    logits = torch.randn(3, 64)
    before = logits.clone()
    states = [state(SamplingParams(top_p=0.2, seed=1)), state(SamplingParams(seed=2)), state(SamplingParams(seed=3))]
    Sampler()(logits, states)
    assert torch.equal(logits, before)
