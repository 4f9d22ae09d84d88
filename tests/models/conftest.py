"""Fixtures for the model tests: the bundled model, and a tiny paged runner to drive any model.

``model_path`` and ``hf_model`` (transformers' reference) come from tests/conftest.py.
"""

from __future__ import annotations

import functools
import random
import shutil
from pathlib import Path

import pytest
import torch

from servelm import kernels
from servelm.engine.kv_cache import allocate_kv_caches
from servelm.layers.attention import AttentionMetadata
from servelm.models.config import ModelConfig
from servelm.models.llama import LlamaForCausalLM, build_empty_model
from servelm.models.packed import PAIR_MAX_ROWS, PackedLinear, can_pack, replace_linears
from servelm.models.quantization import quantize_int8
from servelm.models.w8a8 import quantize_w8a8


@pytest.fixture(scope="session")
def native_kernels():
    """servelm's CPU kernels: a failure where C and C++ compilers are but they did not build, a skip where
    either is missing."""
    built = kernels.cpu_kernels()
    if built is None:
        if shutil.which("cc") is not None and shutil.which("c++") is not None:
            pytest.fail("C and C++ compilers are here but servelm's CPU kernels did not build (see the warning)")
        pytest.skip("no C or C++ compiler: the native kernels cannot be built on this machine")
    return built


@pytest.fixture(params=["native", "torch"])
def cpu_ops(request, monkeypatch):
    """Runs a test twice: with servelm's native CPU kernels, and with them off (the PyTorch path)."""
    if request.param == "torch":
        monkeypatch.setattr(kernels, "cpu_kernels", lambda: None)
    else:
        request.getfixturevalue("native_kernels")
    return request.param


class PagedRunner:
    """Drives a model step by step over a paged KV cache, as the engine would, with shuffled blocks; the cache
    in the model's dtype, or in int8 (``kv_int8``)."""

    def __init__(
        self, model, config, block_size: int = 4, num_blocks: int = 128, seed: int = 0, kv_int8: bool = False
    ) -> None:
        self.model = model
        self.block_size = block_size
        device = next(model.parameters()).device
        dtype = torch.int8 if kv_int8 else next(model.parameters()).dtype
        self.kv_caches = allocate_kv_caches(config, num_blocks, block_size, dtype, device)
        # Hand blocks out in random order, so contiguous-block assumptions would show.
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, prefills: list[tuple[str, list[int]]], decodes: list[tuple[str, int]] = ()) -> list[torch.Tensor]:
        """Run one batch; returns float32 logits per sequence, ``[new_tokens, vocab]`` each."""
        work = list(prefills) + [(seq, [token]) for seq, token in decodes]
        input_ids, positions, slots, query_lens, context_lens = [], [], [], [], []
        for seq, ids in work:
            start = self.lens.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            end = start + len(ids)
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            input_ids += ids
            positions += range(start, end)
            slots += [table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)]
            query_lens.append(len(ids))
            context_lens.append(end)
            self.lens[seq] = end
        width = max(len(self.tables[seq]) for seq, _ in work)
        tables = [self.tables[seq] + [0] * (width - len(self.tables[seq])) for seq, _ in work]
        device = self.kv_caches[0].device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=device),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=torch.tensor(tables, device=device),
            num_prefills=len(prefills),
            num_prefill_tokens=sum(len(ids) for _, ids in prefills),
            decode_lens=torch.tensor(context_lens[len(prefills) :], device=device)
            if len(prefills) < len(context_lens)
            else None,
        )
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(input_ids, device=device), torch.tensor(positions, device=device), self.kv_caches, meta
            )
            logits = self.model.compute_logits(hidden)
        return list(logits.split(query_lens))


def tiny_llama_model(weights: str, **overrides) -> tuple[LlamaForCausalLM, ModelConfig]:
    """A random bfloat16 Llama of 3 small layers whose linears are packed with plain weights kept ("bf16"),
    with the small-GEMM pair layout where it runs ("pairs": on the vector unit up to ``PAIR_MAX_ROWS`` rows;
    "pairs1": for one row, and from 2 rows on AMX tiles where the CPU has them, as decoding runs there), int8
    ("int8") or int8 weights and activations ("w8a8"); ``overrides`` set config fields."""
    fields = dict(
        architecture="LlamaForCausalLM",
        vocab_size=120,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    )
    config = ModelConfig(**(fields | overrides))
    model = build_empty_model(config, torch.bfloat16, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        param.copy_(1 + 0.1 * noise if "norm" in name else noise * param.shape[-1] ** -0.5)
    head = model.model.embed_tokens.weight if model.lm_head is None else None
    if weights == "int8":
        quantize_int8(model, head)
    elif weights == "w8a8":
        quantize_w8a8(model, head)
    else:
        if not can_pack(torch.bfloat16, torch.device("cpu")):
            pytest.skip("this torch build has no oneDNN bfloat16 packing")
        # "pairs": the small-GEMM layout where it runs (not for the 120-row head, which stays plain)
        rows = {"pairs": PAIR_MAX_ROWS, "pairs1": 1}.get(weights, 0)
        replace_linears(model, functools.partial(PackedLinear, keep_plain=True, pair_rows=rows), head)
    return model, config


@pytest.fixture(scope="session")
def tiny_llama():
    """``tiny_llama_model``: a fresh random model per call."""
    return tiny_llama_model


@pytest.fixture(scope="session")
def paged_runner():
    """The ``PagedRunner`` class."""
    return PagedRunner


@pytest.fixture(scope="session")
def smollm(model_path):
    """(model, config, tokenizer) of the bundled model, float32 on the CPU, loaded once per session."""
    from servelm.models.loader import load_model

    return load_model("smollm2-135m-instruct", torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, model_path) -> Path:
    """A HF tokenizer folder (tokenizer.json, tokenizer_config.json, chat template) saved from the bundled GGUF."""
    from servelm.models.tokenizer import load_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(model_path).hf.save_pretrained(folder)
    return folder
