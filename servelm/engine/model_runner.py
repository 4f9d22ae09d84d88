"""The model runner: turns one scheduled step into one model call and samples.

It owns the model, the paged KV cache and the sampler. Each step it lays the
scheduled sequences out as one flattened batch (prefill chunks first, then
decodes, no padding), builds the slot mapping and block tables the attention
layers read, runs the model once and samples one token for every sequence
whose chunk reached its end.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from servelm.engine.config import EngineConfig
from servelm.engine.device import resolve_device, resolve_dtype
from servelm.engine.sample_isolation import sample_isolated
from servelm.engine.sampler import Sampler, SamplingState
from servelm.engine.scheduler import SchedulerOutput
from servelm.kernels import cpu_kernels
from servelm.layers.attention import AttentionMetadata
from servelm.models.loader import load_model
from servelm.models.weight_layout import free_memory_bytes, lay_out_weights
from servelm.platform.memory import keep_freed_memory

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

    ``sampled``: seq_id -> its sampled token, for every sequence that sampled.
    ``prompt_logprobs``: seq_id -> the prompt logprobs its prefill chunk
    computed, one per position of the chunk whose next token is a prompt token.
    ``failed``: the sequences whose own sampling raised (logged by the
    sampler's isolation); the others sampled normally.
    """

    sampled: dict[int, SampledToken] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[PromptLogprob]] = field(default_factory=dict)
    failed: list[int] = field(default_factory=list)


class ModelRunner:
    """Owns the model, the KV cache and the sampler; runs one step at a time."""

    def __init__(self, model: str, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cpu":
            keep_freed_memory()
            cpu_kernels()  # build them now (once per machine), not in the first step
        self.model, self.model_config, self.tokenizer = load_model(model, self.dtype, self.device)
        lay_out_weights(self.model, config.quantization, config.cpu_matmul)
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_model_len, mc.max_model_len)
        self.block_size = config.block_size
        self.num_blocks = self._num_kv_blocks()
        shape = (2, self.num_blocks, self.block_size, mc.num_key_value_heads, mc.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(mc.num_hidden_layers)
        ]
        self.sampler = Sampler()
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_bytes / 2**20,
        )

    @property
    def block_bytes(self) -> int:
        mc = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * mc.num_hidden_layers * self.block_size * mc.num_key_value_heads * mc.head_dim * elem

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
    ) -> StepResult:
        """Run one scheduled step.

        ``sampling`` holds the sampling state of every sequence that samples
        this step; ``want_prompt_logprobs`` maps seq_id to k for prefill
        chunks whose prompt logprobs are wanted.
        """
        scheduled = out.scheduled
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []  # flattened index of the last token of each sampling chunk
        sample_seqs: list[int] = []
        sample_requests: list[str] = []
        prompt_rows: dict[int, tuple[int, int]] = {}  # seq_id -> (first row, start position)
        bs = self.block_size
        for sch in scheduled:
            seq = sch.seq
            start = seq.num_computed_tokens
            end = start + sch.num_new_tokens
            row0 = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(end - start)
            context_lens.append(end)
            tables.append(table)
            if sch.is_sampling:
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq.seq_id)
                sample_requests.append(seq.request_id)
            if seq.seq_id in want_prompt_logprobs:
                prompt_rows[seq.seq_id] = (row0, start)

        dev = self.device
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
        num_prefills = len(out.prefills)
        decode_lens = context_lens[num_prefills:]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=block_tables.to(dev),
            num_prefills=num_prefills,
            num_prefill_tokens=sum(query_lens[:num_prefills]),
            decode_lens=torch.tensor(decode_lens, dtype=torch.long, device=dev) if decode_lens else None,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
        )

        result = StepResult()
        if sample_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
            states = [sampling[s] for s in sample_seqs]
            for i, row in enumerate(sample_isolated(self.sampler, logits, states, sample_requests)):
                seq_id = sample_seqs[i]
                if row is None:
                    result.failed.append(seq_id)
                else:
                    result.sampled[seq_id] = SampledToken(*row)
        for sch in out.prefills:
            seq = sch.seq
            if seq.seq_id in prompt_rows:
                row0, start = prompt_rows[seq.seq_id]
                result.prompt_logprobs[seq.seq_id] = self._prompt_logprobs(
                    hidden, row0, start, sch.num_new_tokens, seq, want_prompt_logprobs[seq.seq_id]
                )
        return result

    def _prompt_logprobs(self, hidden, row0, start, num_new, seq, k) -> list[PromptLogprob]:
        # Row r predicts token r + 1; only positions whose next token is a
        # prompt token count (the last prompt position predicts the first
        # generated token, which the sampler reports).
        n = min(num_new, seq.num_prompt_tokens - 1 - start)
        if n <= 0:
            return []
        logprobs = torch.log_softmax(self.model.compute_logits(hidden[row0 : row0 + n]), dim=-1)
        targets = torch.tensor(seq.token_ids[start + 1 : start + 1 + n], device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        if k > 0:
            top_vals, top_ids = logprobs.topk(k, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_vals.tolist())]
        else:
            tops = [[] for _ in range(n)]
        return [PromptLogprob(start + 1 + j, chosen[j], tops[j]) for j in range(n)]
