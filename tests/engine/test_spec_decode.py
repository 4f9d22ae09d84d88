"""Speculative decoding's pure parts, without a model: n-gram lookup, the acceptance rule, verification.

The rejection sampler's promise is that every token it emits follows the
target distribution. The statistical tests check it on small vocabularies:
a Markov chain target and a different proposal chain generate many short
sequences through the speculative loop, and the frequency of every
sequence is compared with its exact probability, within a tolerance derived
from the sample size (a fixed seed keeps the run reproducible).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from servelm.engine.sampler import SamplingState
from servelm.engine.sampling_params import SamplingParams
from servelm.engine.spec_decode.ngram import ngram_proposal
from servelm.engine.spec_decode.rejection_sampler import greedy_accept, rejection_sample, sampling_distribution
from servelm.engine.spec_decode.verifier import Speculation, row_states, verify, verify_isolated

# ---- n-gram prompt lookup -----------------------------------------------------


def test_ngram_proposes_what_followed_the_tail_earlier():
    assert ngram_proposal([1, 2, 3, 4, 9, 1, 2], 1, 3, 2) == [3, 4]
    assert ngram_proposal([1, 2, 3, 4, 9, 1, 2], 1, 3, 10) == [3, 4, 9, 1, 2]  # up to the end
    assert ngram_proposal([1, 2, 3], 1, 3, 4) == []  # 3 never occurred before
    assert ngram_proposal([7], 1, 3, 4) == []


def test_ngram_prefers_the_longest_tail_then_the_latest_occurrence():
    # The 1-gram "2" last occurred before 8, but the 2-gram "1 2" occurred before 3: the longer match wins.
    assert ngram_proposal([1, 2, 3, 0, 2, 8, 1, 2], 1, 2, 1) == [3]
    # Two occurrences of the same tail: the latest one's continuation.
    assert ngram_proposal([5, 1, 5, 2, 5], 1, 1, 1) == [2]
    # min_n bounds the tail: no 2-gram "0 5" occurred before.
    assert ngram_proposal([5, 1, 5, 2, 0, 5], 2, 3, 1) == []


def test_ngram_may_overlap_the_tail():
    assert ngram_proposal([4, 5, 5, 5], 1, 3, 3) == [5]
    assert ngram_proposal([1, 2, 1, 2, 1, 2], 1, 4, 3) == [1, 2]


def _reference_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n > len(tokens) - 1:
            continue
        tail = tokens[-n:]
        for i in range(len(tokens) - 1 - n, -1, -1):  # occurrences ending before the last token, latest first
            if tokens[i : i + n] == tail:
                return tokens[i + n : i + n + k]
    return []


@given(
    st.lists(st.integers(0, 3), max_size=40),
    st.integers(1, 3),
    st.integers(0, 3),
    st.integers(0, 5),
)
def test_ngram_matches_a_plain_search(tokens, min_n, extra, k):
    max_n = min_n + extra
    assert ngram_proposal(tokens, min_n, max_n, k) == (_reference_lookup(tokens, min_n, max_n, k) if k else [])


# ---- the acceptance rule --------------------------------------------------------


def test_greedy_accept_keeps_the_agreeing_prefix_then_the_targets_choice():
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert greedy_accept([5, 0, 7, 8], [5, 6, 7]) == [5, 0]
    assert greedy_accept([1, 6, 7, 8], [5, 6, 7]) == [1]
    assert greedy_accept([3], []) == [3]


def _chain(vocab: int, seed: int, zeros: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(vocab, vocab, generator=g, dtype=torch.float64) + 0.05
    if zeros:  # a truncated target (top-k, top-p): some tokens impossible after some tokens
        p[torch.arange(vocab), (torch.arange(vocab) + 1) % vocab] = 0.0
    return p / p.sum(dim=1, keepdim=True)


def _speculative_sequences(target, proposal_chain, k, length, samples, seed):
    """``samples`` sequences of ``length`` tokens after token 0, generated speculatively.

    ``proposal_chain`` is a matrix to sample proposals from, or a function of
    the last token giving a deterministic (point-mass) proposal.
    """
    g = torch.Generator().manual_seed(seed)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(samples):
        tokens = [0]
        while len(tokens) <= length:
            proposal, qs = [], []
            last = tokens[-1]
            for _ in range(k):
                if callable(proposal_chain):
                    last = proposal_chain(last)
                else:
                    qs.append(proposal_chain[last])
                    last = int(torch.multinomial(proposal_chain[last], 1, generator=g))
                proposal.append(last)
            rows = torch.stack([target[t] for t in [tokens[-1], *proposal]])
            q = torch.stack(qs) if qs else None
            tokens += rejection_sample(rows, proposal, q, g)
        key = tuple(tokens[1 : length + 1])
        counts[key] = counts.get(key, 0) + 1
    return counts


def _assert_follows_the_chain(counts, target, length, samples):
    vocab = target.shape[0]
    for seq in itertools.product(range(vocab), repeat=length):
        p, last = 1.0, 0
        for t in seq:
            p *= float(target[last, t])
            last = t
        freq = counts.get(seq, 0) / samples
        # 5 standard deviations of a binomial frequency: a true distribution fails one of these
        # 27 cells with probability below 1e-4.
        tolerance = 5 * math.sqrt(max(p * (1 - p), 1e-12) / samples) + 1 / samples
        assert abs(freq - p) <= tolerance, (seq, freq, p, tolerance)


@pytest.mark.parametrize("zeros", [False, True])
def test_rejection_sampling_from_a_draft_distribution_follows_the_target(zeros):
    vocab, length, samples = 3, 3, 8000
    target, draft = _chain(vocab, 1, zeros), _chain(vocab, 2)
    counts = _speculative_sequences(target, draft, k=2, length=length, samples=samples, seed=3)
    _assert_follows_the_chain(counts, target, length, samples)


@pytest.mark.parametrize("zeros", [False, True])
def test_rejection_sampling_of_point_mass_proposals_follows_the_target(zeros):
    vocab, length, samples = 3, 3, 8000
    target = _chain(vocab, 4, zeros)
    counts = _speculative_sequences(target, lambda t: (t + 1) % vocab, k=3, length=length, samples=samples, seed=5)
    _assert_follows_the_chain(counts, target, length, samples)


def test_a_proposal_drawn_from_the_target_itself_is_always_kept():
    p = _chain(5, 6)
    rows = torch.stack([p[0], p[1], p[2]])
    for seed in range(50):
        assert rejection_sample(rows, [1, 2], rows[:2], torch.Generator().manual_seed(seed))[:2] == [1, 2]


def test_a_proposed_token_the_target_rules_out_is_never_kept():
    rows = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]], dtype=torch.float64)
    for seed in range(50):
        run = rejection_sample(rows, [0], None, torch.Generator().manual_seed(seed))
        assert len(run) == 1 and run[0] in (1, 2)


# ---- verification ----------------------------------------------------------------


def _state(params: SamplingParams, tokens: list[int], num_prompt: int = 1) -> SamplingState:
    return SamplingState(
        params=params, token_ids=tokens, num_prompt_tokens=num_prompt, generator=None, eos_token_ids=set()
    )


def test_row_states_see_the_proposed_tokens_before_their_row():
    state = _state(SamplingParams(temperature=0.0), [9, 4])
    rows = row_states(state, [1, 2])
    assert [r.token_ids for r in rows] == [[9, 4], [9, 4, 1], [9, 4, 1, 2]]
    assert rows[0] is state and state.token_ids == [9, 4]


def test_greedy_verification_applies_each_rows_processors_and_reports_raw_logprobs():
    # Row 0 picks token 1 (the proposal). At row 1 token 1 leads, but a presence penalty on the
    # proposed (now generated) 1 makes token 2 the choice, as plain decoding would see it.
    logits = torch.tensor([[0.0, 5.0, 0.0, 0.0], [0.0, 3.0, 2.9, 0.0]])
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=1)
    (run,) = verify(logits, [Speculation("r", _state(params, [0]), [1])])
    raw = torch.log_softmax(logits, dim=-1)
    assert [t for t, _, _ in run] == [1, 2]
    assert [lp for _, lp, _ in run] == pytest.approx([raw[0, 1].item(), raw[1, 2].item()])
    assert run[1][2] == [(1, pytest.approx(raw[1, 1].item()))]  # the top raw logprob, unpenalized


def test_sampled_verification_never_keeps_a_token_top_k_rules_out():
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0], [0.0, 1.0, 2.0, 3.0]])
    params = SamplingParams(temperature=1.0, top_k=2)
    for _ in range(30):
        (run,) = verify(logits, [Speculation("r", _state(params, [0]), [2])])
        assert run[0][0] in (0, 1) and len(run) == 1


def test_sampling_distribution_of_a_degenerate_row_is_its_greedy_token():
    logits = torch.tensor([[1.0, 2.0, 0.5], [float("-inf")] * 3])
    raw = torch.tensor([[1.0, 2.0, 0.5], [0.1, 0.2, 3.0]])
    states = [_state(SamplingParams(temperature=1.0), [0])] * 2
    probs = sampling_distribution(logits, raw, states)
    assert probs[0].tolist() == pytest.approx(torch.softmax(logits[0], -1).tolist())
    assert probs[1].tolist() == [0.0, 0.0, 1.0]


def test_a_speculation_whose_verification_raises_fails_alone():
    good = Speculation("a", _state(SamplingParams(temperature=0.0), [0]), [1])
    bad = Speculation("b", _state(SamplingParams(temperature=0.0), [0]), [1], torch.zeros(3, 3))
    bad.state.params = None  # anything reading its params raises
    logits = torch.tensor([[0.0, 5.0, 0.0], [3.0, 0.0, 0.0], [0.0, 5.0, 0.0], [3.0, 0.0, 0.0]])
    runs = verify_isolated(logits, [good, bad])
    assert runs[1] is None and [t for t, _, _ in runs[0]] == [1, 0]
