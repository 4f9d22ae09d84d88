"""Draft-model proposals: a smaller model with the target's tokenizer guesses the next tokens.

The draft keeps its own paged KV cache in the target's block layout: the
same block ids and slots, so a sequence's block table serves both models
and the block manager's allocation, rollback and freeing cover the draft's
K/V too. The draft's cache is filled lazily: a sequence's first speculating
step computes its whole context in the draft (its blocks may have come from
the prefix cache, whose draft slots nobody vouches for), later steps only the
tokens the draft has not seen (``Sequence.num_draft_computed``). Wrong draft
K/V can only make proposals worse, never output wrong: the target verifies
every proposed token.
"""

from __future__ import annotations

import torch

from servelm.engine.flat_batch import Chunk, flatten
from servelm.engine.kv_cache import allocate_kv_caches, kv_block_bytes
from servelm.engine.logits_processors import apply_logits_processors
from servelm.engine.sampler import SamplingState, greedy_tokens, is_greedy, random_choice
from servelm.engine.scheduler import ScheduledSeq
from servelm.engine.spec_decode.rejection_sampler import sampling_distribution
from servelm.engine.spec_decode.verifier import state_after
from servelm.models.loader import load_model
from servelm.models.tokenizer import Tokenizer
from servelm.models.weight_layout import lay_out_weights


class DraftModel:
    """The draft model and its KV cache (allocated once the target sized the cache: :meth:`allocate`)."""

    def __init__(
        self,
        path: str,
        dtype: torch.dtype,
        device: torch.device,
        quantization: str,
        cpu_matmul: str,
        target_tokenizer: Tokenizer,
    ):
        self.model, self.model_config, tokenizer = load_model(path, dtype, device)
        lay_out_weights(self.model, quantization, cpu_matmul)
        if tokenizer.hf.get_vocab() != target_tokenizer.hf.get_vocab():
            raise ValueError(f"the draft model {path} does not share the target model's tokenizer vocabulary")
        self.dtype, self.device = dtype, device
        self.max_model_len = self.model_config.max_model_len
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = 0

    def block_bytes(self, block_size: int) -> int:
        """Bytes the draft's K/V take per block of the shared layout."""
        return kv_block_bytes(self.model_config, block_size, self.dtype)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """Make the draft's cache: ``num_blocks`` blocks, as many as the target's."""
        self.block_size = block_size
        self.kv_caches = allocate_kv_caches(self.model_config, num_blocks, block_size, self.dtype, self.device)

    def last_logits(self, chunks: list[Chunk]) -> torch.Tensor:
        """Run the chunks (any lengths, any order) and return the logits of each one's last token, in order."""
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) == 1)
        num_prefills = sum(1 for c in chunks if len(c.token_ids) > 1)
        batch = flatten([chunks[i] for i in order], num_prefills, self.block_size, self.device)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        rows = [0] * len(chunks)
        for flat_index, i in enumerate(order):
            rows[i] = batch.last_rows[flat_index]
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])


class DraftProposer:
    """Proposes by running the draft autoregressively, batched over the speculating sequences."""

    def __init__(self, draft: DraftModel):
        self.draft = draft

    def propose(self, scheds: list[ScheduledSeq], sampling: dict[int, SamplingState]) -> dict[int, torch.Tensor]:
        """Fill each decode's proposal with ``num_lookahead`` draft tokens; returns, for sampled requests,
        seq_id -> the distributions the tokens were drawn from (``[len(proposal), vocab]``).

        A sequence whose proposal would run past the draft's context gets none.
        """
        live = [s for s in scheds if s.seq.num_tokens + s.num_lookahead - 1 <= self.draft.max_model_len]
        if not live:
            return {}
        proposals: list[list[int]] = [[] for _ in live]
        dists: list[list[torch.Tensor]] = [[] for _ in live]
        # First pass: the tokens the draft has not seen, up to the sequence's last.
        chunks = []
        for s in live:
            seq = s.seq
            start = min(seq.num_draft_computed, seq.num_computed_tokens)
            chunks.append(Chunk(seq.token_ids[start:], start, seq.block_table))
        active = list(range(len(live)))
        while True:
            logits = self.draft.last_logits(chunks)
            states = [state_after(sampling[live[i].seq.seq_id], proposals[i]) for i in active]
            tokens, probs = _draw(logits, states)
            for n, i in enumerate(active):
                proposals[i].append(tokens[n])
                drawn_from = probs[n]
                if drawn_from is not None:
                    dists[i].append(drawn_from)
            active = [i for i in active if len(proposals[i]) < live[i].num_lookahead]
            if not active:
                break
            # The next pass feeds each unfinished proposal's newest token at its position.
            chunks = [
                Chunk([proposals[i][-1]], live[i].seq.num_tokens - 1 + len(proposals[i]), live[i].seq.block_table)
                for i in active
            ]
        out: dict[int, torch.Tensor] = {}
        for s, proposal, dist in zip(live, proposals, dists):
            s.propose(proposal)
            # It computed the last token and every proposed one but the newest.
            s.seq.num_draft_computed = s.seq.num_tokens + len(proposal) - 1
            if dist:
                out[s.seq.seq_id] = torch.stack(dist)
        return out


def _draw(logits: torch.Tensor, states: list[SamplingState]) -> tuple[list[int], list[torch.Tensor | None]]:
    """Each row's draft token (the greedy choice for greedy requests, else a draw from the request's sampling
    distribution over the draft's logits) and, for the drawn ones, that distribution."""
    logits = logits.float()
    raw = torch.log_softmax(logits, dim=-1)
    processed = apply_logits_processors(logits, states)
    tokens = greedy_tokens(processed, raw)
    probs: list[torch.Tensor | None] = [None] * len(states)
    sampled = [i for i, s in enumerate(states) if not is_greedy(s.params)]
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        dist = sampling_distribution(processed[index], raw[index], [states[i] for i in sampled])
        tokens[index] = random_choice(dist, [states[i].generator for i in sampled])
        for n, i in enumerate(sampled):
            probs[i] = dist[n]
    return tokens.tolist(), probs
