"""The model runner: turns one scheduled step into one model call and samples.

It owns the model, the paged KV cache and the sampler. Each step it lays the
scheduled sequences out as one flattened batch (prefill chunks first, then
decodes, no padding), builds the slot mapping and block tables the attention
layers read, runs the model once and samples one token for every sequence
whose chunk reached its end.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from servelm.engine.config import EngineConfig
from servelm.engine.device import resolve_device, resolve_dtype
from servelm.engine.malloc import huge_page_copies, keep_freed_memory
from servelm.engine.sampler import Sampler, SamplingState
from servelm.engine.scheduler import SchedulerOutput
from servelm.kernels import cpu_kernels
from servelm.layers.attention import AttentionMetadata
from servelm.models.loader import load_model
from servelm.models.packed import PackedLinear, can_pack, pairs_beat_onednn, replace_linears
from servelm.models.quantization import Int8Linear, quantize_int8

logger = logging.getLogger(__name__)


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class StepResult:
    """What the model produced in one step.

    ``sampled`` maps seq_id to (token id, logprob, top logprobs or None) for
    every sequence that sampled. ``prompt_logprobs`` maps seq_id to, for
    each computed prompt position p of the chunk that has a next prompt
    token, (p + 1, logprob of that token, top (id, logprob) list).
    """

    sampled: dict[int, tuple[int, float, list[tuple[int, float]] | None]]
    prompt_logprobs: dict[int, list[tuple[int, float, list[tuple[int, float]]]]]


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
        if config.quantization == "int8":
            self._quantize_int8()
        elif can_pack(self.dtype, self.device):
            self._pack_weights()
        if self.device.type == "cpu":
            self._stream_weights_from_huge_pages()
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

    def _quantize_int8(self) -> None:
        if self.device.type != "cpu":
            raise ValueError(f"quantization int8 runs on CPU only (its kernel is a CPU one); the device is {self.device}")
        count = quantize_int8(self.model, self._tied_head())
        logger.info("quantized %d linear layers to int8 (weight-only)", count)

    def _pack_weights(self) -> None:
        # Decoding reads a second copy of the weights faster than oneDNN's packed one (packed.py): in the
        # small-GEMM kernel's pair layout where that beats oneDNN (with a tied head's too), else plain for batch 1
        # (a tied head's plain weight is the embedding). It is kept only while it takes at most a quarter
        # of the free memory.
        plain_bytes = sum(m.weight.nbytes for m in self.model.modules() if isinstance(m, nn.Linear))
        head = self._tied_head()
        budget = _free_memory_bytes(self.device) // 4
        keep_pairs = plain_bytes + (head.nbytes if head is not None else 0) <= budget and pairs_beat_onednn()
        keep_plain = plain_bytes <= budget
        make = functools.partial(PackedLinear, keep_plain=keep_plain, keep_pairs=keep_pairs)
        count = replace_linears(self.model, make, head)
        packed = [m for m in self.model.modules() if isinstance(m, PackedLinear)]
        kept = [what for what, attr in (("the pair layout for decoding", "pair_weight"),
                                        ("plain weights for batch 1", "plain_weight"))
                if any(getattr(m, attr) is not None for m in packed)]  # fmt: skip
        logger.info("prepacked %d linear layers for oneDNN%s", count, f" (kept: {', '.join(kept)})" if kept else "")

    def _stream_weights_from_huge_pages(self) -> None:
        # Decoding streams the pair-layout, plain or int8 weights of every layer once per step. On
        # transparent huge pages it takes a TLB miss every 2 MiB instead of every 4 KiB (malloc.py).
        owners = [
            (m, attr)
            for m in self.model.modules()
            for attr in ("plain_weight", "pair_weight")
            if getattr(m, attr, None) is not None
        ]
        owners += [(m, "qweight") for m in self.model.modules() if isinstance(m, Int8Linear)]
        nbytes = sum(getattr(m, a).nbytes for m, a in owners)
        if not owners or nbytes > _free_memory_bytes(self.device) // 2:  # the old copies go only once all are made
            return
        for (module, attr), copy in zip(owners, huge_page_copies([getattr(m, a) for m, a in owners])):
            setattr(module, attr, copy)
        head = self.model.lm_head
        if self.model.config.tie_word_embeddings and getattr(head, "plain_weight", None) is not None:
            # The head's plain weight was the embedding itself: keep it so, with no second copy.
            self.model.model.embed_tokens.weight = nn.Parameter(head.plain_weight, requires_grad=False)

    def _tied_head(self) -> torch.Tensor | None:
        """The embedding's weight when the LM head is tied to it (no head module of its own), else None."""
        model = self.model
        return model.model.embed_tokens.weight if model.lm_head is None else None

    @property
    def block_bytes(self) -> int:
        mc = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * mc.num_hidden_layers * self.block_size * mc.num_key_value_heads * mc.head_dim * elem

    def _num_kv_blocks(self) -> int:
        budget = self.config.kv_cache_memory
        if isinstance(budget, float):
            budget = int(_free_memory_bytes(self.device) * budget)
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
            if sch.samples:
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq.seq_id)
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

        result = StepResult(sampled={}, prompt_logprobs={})
        if sample_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
            sampled = self.sampler(logits, [sampling[s] for s in sample_seqs])
            for i, seq_id in enumerate(sample_seqs):
                top = sampled.top_logprobs[i] if sampled.top_logprobs is not None else None
                result.sampled[seq_id] = (sampled.token_ids[i], sampled.logprobs[i], top)
        for sch in out.prefills:
            seq = sch.seq
            if seq.seq_id in prompt_rows:
                row0, start = prompt_rows[seq.seq_id]
                result.prompt_logprobs[seq.seq_id] = self._prompt_logprobs(
                    hidden, row0, start, sch.num_new_tokens, seq, want_prompt_logprobs[seq.seq_id]
                )
        return result

    def _prompt_logprobs(self, hidden, row0, start, num_new, seq, k):
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
        return [(start + 1 + j, chosen[j], tops[j]) for j in range(n)]
