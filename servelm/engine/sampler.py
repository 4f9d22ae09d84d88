"""Turn one row of logits per sequence into one sampled token per sequence.

The order of processing follows vLLM: raw logprobs are taken first (they are
what the client sees), then the grammar's token bitmask (structured
outputs), logit_bias, the min_tokens ban on EOS and stop tokens, repetition
penalty, frequency/presence penalties (``logits_processors``); greedy rows
then take the argmax and the others go through temperature, top-k, top-p and
min-p before a random draw (on CPU all in the native draw,
``kernels/sample.c``). Every stage works on the whole batch (or on the rows
that need it) at once, and is skipped when no row needs it.

A grammar is a hard constraint, the other stages are not: a row whose
stages leave no token (min_tokens banning the only end the grammar allows,
a logit_bias of -100 on its only choice) falls back to the best token its
grammar allows, never to one it forbids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from servelm.engine.grammar_matcher import GrammarMatcher, mask_logits
from servelm.engine.logits_processors import apply_logits_processors
from servelm.engine.row_blocks import inverse_cdf, log_softmax_stats, mass_threshold, row_kernels, row_max
from servelm.engine.sampling_params import SamplingParams

# How many of the most likely tokens top-p looks at before it searches a whole row.
_TOP_P_CANDIDATES = 1024
# Dividing by a temperature this small overflows float32, and the
# distribution is indistinguishable from greedy anyway (vLLM does the same).
_GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingState:
    """What the sampler needs to know about one sequence (one row of the batch).

    The engine keeps one per sequence for its whole life. ``token_ids`` is
    the sequence's own list (prompt, then the tokens generated so far), not
    a copy: it grows as the scheduler appends tokens. ``generator`` is set
    for seeded requests so that their draws do not depend on the rest of
    the batch.
    """

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None
    eos_token_ids: set[int]  # banned, with params.stop_token_ids, while fewer than min_tokens were generated
    grammar: GrammarMatcher | None = None  # structured outputs: the tokens its grammar allows next
    _bias: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False, repr=False
    )
    _ban: dict[tuple[int, torch.device], torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    def logit_bias(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's logit_bias as (token ids, values) tensors, made once per vocabulary size
        (a draft model's may differ) and device: a bias may name every token of the vocabulary,
        too many to walk in Python at every step."""
        bias = self._bias.get((vocab, device))
        if bias is None:
            # Ids beyond this vocabulary cannot be sampled anyway.
            pairs = [(t, v) for t, v in (self.params.logit_bias or {}).items() if 0 <= t < vocab]
            bias = self._bias[(vocab, device)] = (
                torch.tensor([t for t, _ in pairs], dtype=torch.long, device=device),
                torch.tensor([v for _, v in pairs], dtype=torch.float32, device=device),
            )
        return bias

    def min_tokens_ban(self, vocab: int, device: torch.device) -> torch.Tensor:
        """The tokens banned while fewer than min_tokens were generated (EOS and the stop tokens), made once."""
        ban = self._ban.get((vocab, device))
        if ban is None:
            ids = sorted(t for t in self.eos_token_ids | set(self.params.stop_token_ids) if 0 <= t < vocab)
            ban = self._ban[(vocab, device)] = torch.tensor(ids, dtype=torch.long, device=device)
        return ban

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class SamplerOutput:
    """One sampled token per row, with its logprob under the raw model distribution.

    ``top_logprobs`` is None when no row asked for logprobs; otherwise it has
    one entry per row: None for rows that did not ask, else the
    ``params.logprobs`` highest raw logprobs as (token id, logprob), highest
    first (an empty list for ``logprobs=0``).
    """

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]] | None] | None


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator on ``device`` seeded with ``seed``, or None when there is no seed."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    # manual_seed takes 64 bits; a client may send any integer.
    generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return generator


def is_greedy(params: SamplingParams) -> bool:
    """True when the sampler takes the argmax for these params."""
    return params.greedy or params.temperature < _GREEDY_TEMPERATURE


class Sampler:
    """Samples one token per row of a ``[num_rows, vocab]`` logits tensor.

    Stateless: everything per sequence lives in its :class:`SamplingState`.
    Works on whatever device the logits are on.
    """

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        """Sample row ``i`` of ``logits`` (any float dtype) under ``states[i]``."""
        if logits.shape[0] != len(states):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(states)} sampling states")
        logits = logits.float()
        allowed = mask_logits(logits, [s.grammar for s in states])
        processed = apply_logits_processors(allowed, states)
        # The raw logprobs are logits - largest - logsum: no [rows, vocab] log-softmax is written. Where every
        # row draws from the raw logits on CPU, the draw's own pass over each row gives them.
        drawn = _drawn_with_stats(logits, states) if processed is logits else None
        if drawn is not None:
            token_ids, largest, logsum = drawn
        else:
            largest, index, logsum = log_softmax_stats(logits)
            # The fallback of a row left with no token is its grammar's best, not the raw argmax.
            token_ids = _choose(processed, allowed, states, (largest, index) if processed is logits else None)
        chosen = logits.gather(1, token_ids[:, None])[:, 0] - largest - logsum
        return SamplerOutput(
            token_ids=token_ids.tolist(),
            logprobs=chosen.tolist(),
            top_logprobs=top_logprobs(logits, states, (largest, logsum)),
        )


def _choose(
    x: torch.Tensor, raw: torch.Tensor, states: list[SamplingState], top: tuple[torch.Tensor, torch.Tensor] | None
) -> torch.Tensor:
    greedy = [is_greedy(s.params) for s in states]
    if all(greedy):
        return greedy_tokens(x, raw, top)
    if not any(greedy):
        return _sample(x, raw, states)
    dev = x.device
    tokens = torch.empty(len(states), dtype=torch.long, device=dev)
    g_idx = [i for i, g in enumerate(greedy) if g]
    s_idx = [i for i, g in enumerate(greedy) if not g]
    g_rows = torch.tensor(g_idx, device=dev)
    s_rows = torch.tensor(s_idx, device=dev)
    tokens[g_rows] = greedy_tokens(x[g_rows], raw[g_rows])
    tokens[s_rows] = _sample(x[s_rows], raw[s_rows], [states[i] for i in s_idx])
    return tokens


def greedy_tokens(
    x: torch.Tensor, raw: torch.Tensor, top: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """Each row's argmax, ignoring NaN; a row with nothing above -inf takes ``raw``'s argmax.

    ``x`` holds processed logits and ``raw`` the model's (with a grammar's
    bitmask applied, for constrained rows); ``top``, where known, is
    ``x.max(dim=-1)``. A row whose processing left no
    finite choice (every token banned, or NaN from a
    degenerate model output) still gets a valid token id rather than an
    error that would fail the whole batch.
    """
    values, tokens = top if top is not None else row_max(x)
    bad = ~(values > float("-inf"))  # NaN compares false too
    if bad.any():
        tokens = tokens.clone()  # ``top``'s own may be the caller's
        rows = bad.nonzero()[:, 0]
        neg_inf = torch.tensor(float("-inf"), device=x.device)
        cleaned = torch.where(x[rows].isnan(), neg_inf, x[rows])
        fallback = torch.where(raw[rows].isnan(), neg_inf, raw[rows]).max(dim=-1).indices
        values, picked = cleaned.max(dim=-1)
        tokens[rows] = torch.where(values > float("-inf"), picked, fallback)
    return tokens


def _sample(x: torch.Tensor, raw: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then one random draw per row.

    A row whose distribution degenerates (no finite, positive probability
    left: everything banned, or an overflow to infinity) takes the greedy
    token of its processed logits instead; the other rows are unaffected.
    On CPU the kernels draw from the logits as they are, the temperature
    and the truncations applied as they go: no ``[rows, vocab]``
    distribution is written, no row sorted.
    """
    drawn = _native_draw(x, states)
    if drawn is not None:
        tokens = drawn[0]
        degenerate = tokens < 0
    else:
        probs, degenerate = sampling_probs(x, states)
        # The draw runs for every row, so seeded rows consume their generators as always.
        generators = [s.generator for s in states]
        tokens = random_choice(torch.where(degenerate[:, None], 1.0, probs) if degenerate.any() else probs, generators)
    if degenerate.any():
        bad = degenerate.nonzero()[:, 0]
        tokens[bad] = greedy_tokens(x[bad], raw[bad])
    return tokens


def _native_draw(
    x: torch.Tensor, states: list[SamplingState]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The native kernel's draw from ``x`` (``kernels.CpuKernels.draw``: tokens, -1 for a row with no
    distribution, and the rows' largest values and logsums), or None where it does not run."""
    native = row_kernels(x)
    if native is None:
        return None
    params = [s.params for s in states]
    return native.draw(
        x,
        torch.tensor([1.0 / p.temperature for p in params]),
        torch.tensor([p.top_k for p in params]),
        torch.tensor([p.top_p for p in params]),
        torch.tensor([p.min_p for p in params]),
        uniforms(len(states), [s.generator for s in states], x.dtype, x.device)[:, 0],
    )


def _drawn_with_stats(
    logits: torch.Tensor, states: list[SamplingState]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(tokens, largest, logsum) where every row draws from the raw ``logits`` in the native kernel: one pass
    over each row for both the draw and its logprobs; None where a row is greedy or the kernel does not run
    (no random number used then). A row with no distribution takes its greedy token, as in ``_sample``."""
    if any(is_greedy(s.params) for s in states):
        return None
    drawn = _native_draw(logits, states)
    if drawn is None:
        return None
    tokens, largest, logsum = drawn
    degenerate = tokens < 0
    if degenerate.any():  # rare: the stats the usual way too (the kernel's lack them for a row it had no memory for)
        bad = degenerate.nonzero()[:, 0]
        tokens[bad] = greedy_tokens(logits[bad], logits[bad])
        largest, _, logsum = log_softmax_stats(logits)
    return tokens, largest, logsum


def sampling_probs(x: torch.Tensor, states: list[SamplingState]) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution each row's random draw samples from, and which rows degenerate.

    ``x`` holds processed logits; temperature, top-k, top-p and min-p apply,
    then softmax. A degenerate row (True in the second tensor) has no finite,
    positive probability left, and its draw must fall back to greedy.
    """
    dev, vocab = x.device, x.shape[1]
    params = [s.params for s in states]
    if any(p.temperature != 1.0 for p in params):  # 1.0 (OpenAI's default) leaves a row as it is
        x = x / torch.tensor([p.temperature for p in params], device=dev)[:, None]
    stages = (
        (apply_top_k, [i for i, p in enumerate(params) if 0 < p.top_k < vocab], "top_k"),
        (apply_top_p, [i for i, p in enumerate(params) if p.top_p < 1.0], "top_p"),
        (apply_min_p, [i for i, p in enumerate(params) if p.min_p > 0.0], "min_p"),
    )
    for stage, rows, name in stages:
        if rows:
            # Only the rows that asked: a row's result must not depend on its batch mates.
            values = [getattr(params[i], name) for i in rows]
            if len(rows) == len(params):
                x = stage(x, values)
            else:
                index = torch.tensor(rows, device=dev)
                x = x.index_copy(0, index, stage(x[index], values))  # not in place: x may be the raw logits
    probs = x.softmax(dim=-1)
    # Softmax spreads a NaN or an infinity in a row, or a row of nothing but -inf, as NaN over the whole
    # row, so the sum alone tells a degenerate row, in one pass rather than isfinite's four.
    return probs, ~(probs.sum(dim=-1) > 0)


def apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep each row's ``k`` highest logits (ties with the k-th are kept); k <= 0 keeps all."""
    vocab = logits.shape[1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    top = logits.topk(max(ks), dim=-1).values
    threshold = top.gather(1, torch.tensor(ks, device=logits.device)[:, None] - 1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose probability reaches ``p``.

    Tokens exactly as likely as the least likely one kept are kept too.
    """
    probs = logits.softmax(dim=-1)
    p = torch.tensor(top_p, device=logits.device)[:, None]
    vocab = probs.shape[1]
    # The nucleus of a real model's distribution is nearly always among its
    # top few hundred tokens, and their running sum is cheap.
    candidates = probs.topk(min(_TOP_P_CANDIDATES, vocab), dim=-1).values
    cutoff, num_kept = _nucleus_cutoff(candidates, p)
    # A nucleus that fills every candidate may go on beyond them (a flat distribution): the cutoff is then
    # found from bucket sums over the whole row, 6-20x faster than a sort of it (bench/sampler_top_p.py).
    unsure = (num_kept[:, 0] == candidates.shape[1]) & (candidates.shape[1] < vocab)
    if unsure.any():
        rows = unsure.nonzero()[:, 0]
        cutoff[rows] = mass_threshold(probs[rows], p[rows])
    return logits.masked_fill(probs < cutoff, float("-inf"))


def _nucleus_cutoff(sorted_probs: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's smallest kept probability, and how many of the columns are kept."""
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # mass_before only grows, so the kept tokens are a prefix; the first (mass 0 < p) always stays.
    # At least one: a NaN row (caught after softmax) must not index column -1.
    num_kept = (mass_before < p).sum(dim=-1, keepdim=True).clamp_(min=1)
    return sorted_probs.gather(1, num_kept - 1), num_kept


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, device=logits.device)[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def random_choice(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Draw one index per row from ``probs`` (rows sum to 1, up to rounding).

    Inverse transform: one uniform number per row (:func:`uniforms`), looked
    up in the row's running sum (``row_blocks.inverse_cdf``).
    """
    return inverse_cdf(probs, uniforms(probs.shape[0], generators, probs.dtype, probs.device))


def uniforms(
    rows: int, generators: list[torch.Generator | None], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``[rows, 1]`` numbers drawn uniformly from [0, 1), one per row. A row with a generator draws its number
    from that generator alone, so its token does not depend on the rest of the batch."""
    u = torch.empty(rows, 1, dtype=dtype, device=device)
    if any(g is None for g in generators):
        u.uniform_()
    for i, g in enumerate(generators):
        if g is not None:
            u[i].uniform_(generator=g)
    return u


def top_logprobs(
    raw_logprobs: torch.Tensor,
    states: list[SamplingState],
    stats: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[list[tuple[int, float]] | None] | None:
    """Each row's ``params.logprobs`` highest raw logprobs, as in :class:`SamplerOutput`.

    With ``stats`` (each row's ``largest`` and ``logsum``, as :func:`log_softmax_stats` gives them),
    ``raw_logprobs`` holds the logits instead, whose logprobs are ``logits - largest - logsum``.
    """
    wanted = {i: k for i, s in enumerate(states) if (k := s.params.logprobs) is not None}
    if not wanted:
        return None
    asking = list(wanted)
    result: list[list[tuple[int, float]] | None] = [None] * len(states)
    vocab = raw_logprobs.shape[1]
    max_k = min(max(wanted.values()), vocab)
    rows = torch.tensor(asking, device=raw_logprobs.device)
    native = row_kernels(raw_logprobs)
    if native is not None:
        values, ids = native.top_values(raw_logprobs, rows, max_k)
    else:
        values, ids = raw_logprobs[rows].topk(max_k, dim=-1)
    if stats is not None:
        largest, logsum = stats
        values = values - largest[rows, None] - logsum[rows, None]
    for i, row_ids, row_vals in zip(asking, ids.tolist(), values.tolist()):
        k = min(wanted[i], vocab)
        result[i] = list(zip(row_ids[:k], row_vals[:k]))
    return result
