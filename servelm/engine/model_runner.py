"""The model runner: turns one scheduled step into one model call and samples.

It owns the model, the paged KV cache, the sampler and, for speculative
decoding with a draft model, the draft model and its cache. Each step it
lays the scheduled sequences out as one flattened batch (prefill chunks
first, then decodes, a speculating one with its proposed tokens; no
padding), runs the model once and samples one token for every sequence
whose chunk reached its end, or verifies a speculating decode's proposed
tokens at their k + 1 positions and keeps the accepted run.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch

from servelm.engine.config import EngineConfig
from servelm.engine.cuda_graphs import DecodeGraphs
from servelm.engine.device import resolve_device, resolve_dtype
from servelm.engine.flat_batch import Chunk, FlatBatch, flatten
from servelm.engine.kv_cache import allocate_kv_caches, kv_block_bytes, kv_dtype
from servelm.engine.sample_isolation import sample_isolated
from servelm.engine.sampler import Sampler, SamplingState
from servelm.engine.scheduler import ScheduledSeq, SchedulerOutput
from servelm.engine.sequence import Sequence
from servelm.engine.spec_decode.draft import DraftModel
from servelm.engine.spec_decode.verifier import Speculation, verify_isolated
from servelm.kernels import cpu_kernels
from servelm.models.loader import load_model
from servelm.models.packed import rows_alike
from servelm.models.weight_layout import free_memory_bytes, lay_out_weights
from servelm.platform.memory import heap_only, keep_freed_memory

logger = logging.getLogger(__name__)


@dataclass
class SampledToken:
    """The token a sequence sampled this step, its logprob, and the top (id, logprob) pairs if asked for."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None


@dataclass
class PromptLogprob:
    """The logprob of prompt token ``position`` given the tokens before it, and the top (id, logprob) pairs."""

    position: int
    logprob: float
    top_logprobs: list[tuple[int, float]]


@dataclass
class StepResult:
    """What the model produced in one step.

    ``sampled``: seq_id -> the tokens it sampled, for every sequence that
    sampled: one token, or after a speculative decode the accepted proposed
    tokens and the one the target drew after them.
    ``prompt_logprobs``: seq_id -> the prompt logprobs its prefill chunk
    computed, one per position of the chunk whose next token is a prompt token.
    ``failed``: the sequences whose own sampling raised (logged by the
    sampler's isolation); the others sampled normally.
    """

    sampled: dict[int, list[SampledToken]] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[PromptLogprob]] = field(default_factory=dict)
    failed: list[int] = field(default_factory=list)


class ModelRunner:
    """Owns the model, the KV cache and the sampler; runs one step at a time."""

    def __init__(self, model: str, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = kv_dtype(config.kv_cache_dtype, self.dtype)
        if self.device.type == "cpu":
            keep_freed_memory()
            cpu_kernels()  # build them now (once per machine), not in the first step
        self.model, self.model_config, self.tokenizer = load_model(model, self.dtype, self.device)
        lay_out_weights(self.model, config.quantization, config.cpu_matmul)
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_model_len, mc.max_model_len)
        self.block_size = config.block_size
        self.draft: DraftModel | None = None
        if config.speculative_model is not None:
            self.draft = DraftModel(
                config.speculative_model,
                self.dtype,
                self.device,
                config.quantization,
                config.cpu_matmul,
                self.tokenizer,
            )
        self.num_blocks = self._num_kv_blocks()
        graphs = self.device.type == "cuda" and config.cuda_graphs
        # With CUDA graphs, one block more than the block manager hands out: the padding rows' scratch block.
        self.kv_caches = allocate_kv_caches(mc, self.num_blocks + graphs, self.block_size, self.kv_dtype, self.device)
        self.graphs: DecodeGraphs | None = None
        if graphs:
            recorder = DecodeGraphs(
                self.model, self.kv_caches, config.max_num_seqs, self.max_model_len, self.block_size, self.num_blocks
            )
            self.graphs = self.record_graphs(recorder)
        if self.draft is not None:
            self.draft.allocate(self.num_blocks, self.block_size)
        self.sampler = Sampler()
        if self.device.type == "cpu":
            heap_only()  # the weights and the KV cache are in place: steps reuse what they free
        logger.info(
            "KV cache: %d blocks of %d tokens in %s (%.1f MiB)",
            self.num_blocks,
            self.block_size,
            str(self.kv_dtype).removeprefix("torch."),
            self.num_blocks * self.block_bytes / 2**20,
        )

    @property
    def block_bytes(self) -> int:
        """Bytes one KV block takes: the target's K/V, and the draft model's beside them."""
        draft = self.draft.block_bytes(self.block_size) if self.draft is not None else 0
        return kv_block_bytes(self.model_config, self.block_size, self.kv_dtype) + draft

    def _num_kv_blocks(self) -> int:
        budget = self.config.kv_cache_memory
        if isinstance(budget, float):
            budget = int(free_memory_bytes(self.device) * budget)
        num_blocks = budget // self.block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={self.config.kv_cache_memory} holds no KV block "
                f"(one block needs {self.block_bytes} bytes)"
            )
        return int(num_blocks)

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        sampling: dict[int, SamplingState],
        want_prompt_logprobs: dict[int, int],
        proposal_probs: dict[int, torch.Tensor] | None = None,
    ) -> StepResult:
        """Run one scheduled step.

        ``sampling`` holds the sampling state of every sequence that samples
        this step; ``want_prompt_logprobs`` maps seq_id to k for prefill
        chunks whose prompt logprobs are wanted; ``proposal_probs`` maps a
        speculating seq_id to the distributions its proposed tokens were
        drawn from, where they were drawn (a draft model's sampled proposal).
        """
        verifying = any(d.proposal for d in out.decodes)
        # Verified rows computed as plain decoding computes its one row, logits included (packed.rows_alike).
        with rows_alike() if verifying else contextlib.nullcontext():
            return self._execute(out, sampling, want_prompt_logprobs, proposal_probs, verifying)

    def _execute(
        self,
        out: SchedulerOutput,
        sampling: dict[int, SamplingState],
        want_prompt_logprobs: dict[int, int],
        proposal_probs: dict[int, torch.Tensor] | None,
        verifying: bool,
    ) -> StepResult:
        chunks = [
            Chunk(s.seq.token_ids[s.start : s.start + s.num_new_tokens], s.start, s.seq.block_table)
            for s in out.prefills
        ]
        for d in out.decodes:
            # A speculating decode's last token and proposed ones go in as that many one-token decodes
            # over the same blocks, each seeing the cache up to its own position (all K/V are written
            # before attention reads): the kernels of plain decoding, so greedy output stays its own.
            tokens = [d.seq.token_ids[d.start], *d.proposal]
            chunks.extend(Chunk([t], d.start + j, d.seq.block_table) for j, t in enumerate(tokens))
        batch = flatten(chunks, len(out.prefills), self.block_size, self.device)
        hidden = None if out.prefills or verifying else self._replayed(batch)
        if hidden is None:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)

        # The rows whose logits are needed: each plain sampling chunk's last, and a speculating decode's
        # last token and proposed ones (k + 1 rows), all through the LM head at once.
        plain: list[ScheduledSeq] = [s for s in out.prefills if s.is_sampling]
        plain_rows = [row for s, row in zip(out.prefills, batch.last_rows) if s.is_sampling]
        speculating: list[ScheduledSeq] = []
        specs: list[Speculation] = []
        spec_rows: list[int] = []
        row = batch.meta.num_prefill_tokens
        for d in out.decodes:
            if d.proposal:
                spec_rows.extend(range(row, row + 1 + len(d.proposal)))
                seq_id = d.seq.seq_id
                probs = (proposal_probs or {}).get(seq_id)
                speculating.append(d)
                specs.append(Speculation(d.seq.request_id, sampling[seq_id], d.proposal, probs))
            else:
                plain_rows.append(row)
                plain.append(d)
            row += 1 + len(d.proposal)
        result = StepResult()
        if plain_rows or spec_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(plain_rows + spec_rows, device=self.device)])
            self._sample(logits[: len(plain_rows)], plain, sampling, result)
            if specs:
                runs = verify_isolated(logits[len(plain_rows) :], specs)
                for sch, run in zip(speculating, runs):
                    if run is None:
                        result.failed.append(sch.seq.seq_id)
                    else:
                        result.sampled[sch.seq.seq_id] = [SampledToken(*row) for row in run]
        for i, sch in enumerate(out.prefills):
            seq = sch.seq
            if seq.seq_id in want_prompt_logprobs:
                row0 = batch.last_rows[i] - sch.num_new_tokens + 1
                result.prompt_logprobs[seq.seq_id] = self._prompt_logprobs(
                    hidden, row0, sch.start, sch.num_new_tokens, seq, want_prompt_logprobs[seq.seq_id]
                )
        return result

    @staticmethod
    def record_graphs(graphs: DecodeGraphs) -> DecodeGraphs | None:
        """``graphs`` with every bucket recorded, or None where the GPU or driver cannot record one."""
        try:
            graphs.record_all()
        except RuntimeError:
            # Decode eagerly, as with --no-cuda-graphs.
            logger.exception("recording a CUDA graph failed; decoding without CUDA graphs")
            return None
        return graphs

    def _replayed(self, batch: FlatBatch) -> torch.Tensor | None:
        """A plain decoding step's hidden states from a CUDA graph, or None: no graphs, or none fits it."""
        if self.graphs is None:
            return None
        try:
            return self.graphs.run(batch)
        except RuntimeError:  # recording one of the largest buckets failed (out of memory, say)
            logger.exception("recording a CUDA graph failed; decoding without CUDA graphs from now on")
            self.graphs = None
            return None

    def _sample(
        self, logits: torch.Tensor, plain: list[ScheduledSeq], sampling: dict[int, SamplingState], result: StepResult
    ) -> None:
        if not plain:
            return
        states = [sampling[s.seq.seq_id] for s in plain]
        requests = [s.seq.request_id for s in plain]
        for sch, row in zip(plain, sample_isolated(self.sampler, logits, states, requests)):
            if row is None:
                result.failed.append(sch.seq.seq_id)
            else:
                result.sampled[sch.seq.seq_id] = [SampledToken(*row)]

    def _prompt_logprobs(
        self, hidden: torch.Tensor, row0: int, start: int, num_new: int, seq: Sequence, k: int
    ) -> list[PromptLogprob]:
        # Row r predicts token r + 1; only positions whose next token is a
        # prompt token count (the last prompt position predicts the first
        # generated token, which the sampler reports).
        n = min(num_new, seq.num_prompt_tokens - 1 - start)
        if n <= 0:
            return []
        logprobs = torch.log_softmax(self.model.compute_logits(hidden[row0 : row0 + n]), dim=-1)
        targets = torch.tensor(seq.token_ids[start + 1 : start + 1 + n], device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        tops: list[list[tuple[int, float]]]
        if k > 0:
            top_vals, top_ids = logprobs.topk(k, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_vals.tolist())]
        else:
            tops = [[] for _ in range(n)]
        return [PromptLogprob(start + 1 + j, chosen[j], tops[j]) for j in range(n)]
