"""The engine's settings: the fields of the "engine" and "speculative decoding" groups of
:class:`servelm.settings.Settings`, and the :class:`EngineConfig` they make.

A pydantic model that ``Settings`` inherits, so each setting is still described once
(its flag, environment variable and YAML key come from ``Settings``). Torch-free.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, field_validator, model_validator

from servelm.engine.config import EngineConfig
from servelm.settings_base import none_text, parse_memory, setting


class EngineSettings(BaseModel):
    """What the serving engine is told: dtype, device, batch and cache sizes, quantization, speculation."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto",
        "weight and activation dtype; auto: bfloat16 on CUDA, on CPUs whose bfloat16 matmuls are at least "
        "1.5x faster than float32 ones (measured at start-up and logged), and on CPUs without bfloat16 "
        "instructions for oneDNN (AVX2), where the bfloat16 layers multiply in float32 over weights widened once "
        "and one sequence's decoding reads half of float32's bytes; else float32",
        group="engine",
    )

    device: str = setting(
        "auto",
        "cpu, cuda, cuda:N, mps or auto",
        group="engine",
        metavar="DEVICE",
        pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$",
    )

    max_num_seqs: int = setting(64, "most sequences running in one engine step", group="engine", metavar="N", ge=1)

    max_num_batched_tokens: int = setting(
        2048, "token budget of one engine step (prefill chunks + decodes)", group="engine", metavar="N", ge=1
    )

    max_model_len: int | None = setting(
        None, "context length limit", group="engine", metavar="N", default_text="the model's own", ge=1
    )

    kv_cache_memory: int | float = setting(
        1 << 30,
        "paged KV cache size: bytes (1073741824, 4GiB, 512MB) or a fraction in (0, 1] of free device memory "
        "(of available RAM on CPU), e.g. 0.5",
        group="engine",
        metavar="SIZE",
    )

    kv_cache_dtype: Literal["auto", "int8"] = setting(
        "auto",
        "the KV cache's dtype: auto, the model's; int8 rounds each token's key and value rows per head to int8 "
        "with a float32 scale each, about half the bytes of bfloat16: twice the tokens in kv_cache_memory, and "
        "faster decoding of many or long sequences, whose attention reads the cache at memory speed; greedy "
        "outputs agree with the model's dtype's closely but not exactly (docs/BENCHMARKS.md); servelm's CPU "
        "kernels read it in place with a bfloat16 model on AVX512-BF16 CPUs, other setups through PyTorch",
        group="engine",
    )

    block_size: int = setting(16, "tokens per KV cache block, a power of two", group="engine", metavar="N")

    enable_prefix_caching: bool = setting(
        True, "reuse the KV cache of shared prompt prefixes", group="engine", flag="--prefix-caching"
    )

    seed: int = setting(
        0, "engine random seed (a request's own seed overrides it for that request)", group="engine", metavar="N"
    )

    quantization: Literal["none", "int8", "w8a8"] = setting(
        "none",
        "weights: none, or int8 weight-only on CPU (per-row scales); int8 decodes one sequence faster than "
        "float32 and bfloat16 and keeps a float copy for large batches, so it uses more memory, not less; "
        "w8a8 (CPU) also quantizes activations per token and multiplies int8 by int8, for prefill and batched "
        "decoding (up to twice bfloat16's rate with AVX512-VNNI, on AMX-INT8 tiles where the CPU has them; one "
        "sequence decodes as with int8); greedy "
        "outputs agree with unquantized ones closely but not exactly (docs/BENCHMARKS.md)",
        group="engine",
    )

    cpu_matmul: Literal["auto", "onednn", "pairs"] = setting(
        "auto",
        "bfloat16 matmuls of decoding steps of up to 64 sequences on CPU: pairs (servelm's small-GEMM kernel, "
        "AVX512-BF16 CPUs), onednn (oneDNN's prepacked GEMM), or auto: the faster at 32 rows in a timing at "
        "start-up (logged), and the small-GEMM kernel for one row and for the rows speculative decoding "
        "verifies wherever it runs (so that greedy output stays plain decoding's); pin it for reproducible runs",
        group="engine",
    )

    cuda_graphs: bool = setting(
        True,
        "on CUDA, record decoding steps as CUDA graphs (one per batch and context size, at start-up; the largest, "
        "long contexts at large batches, when first needed) and replay them: one launch a step instead of one per kernel; --no-cuda-graphs runs every step "
        "eagerly, like vLLM's --enforce-eager",
        group="engine",
        flag="--cuda-graphs",
    )

    speculative_method: Literal["none", "ngram", "draft"] = setting(
        "none",
        "none; ngram: prompt lookup, proposing the tokens that followed the last earlier occurrence of the "
        "text's last few tokens (no second model; pays on tasks that repeat their input: rewriting, "
        "summarizing, extraction, code edits); draft: a smaller model with the same tokenizer "
        "(speculative_model) proposes",
        group="speculative decoding",
    )

    speculative_model: str | None = setting(
        None,
        "the draft model of speculative_method draft: a bundled name, a Hugging Face folder or a GGUF file "
        "whose tokenizer is the served model's; its KV cache shares kv_cache_memory",
        group="speculative decoding",
        metavar="NAME_OR_PATH",
        default_text="none",
    )

    num_speculative_tokens: int = setting(
        4, "tokens proposed per sequence and step", group="speculative decoding", metavar="N", ge=1, le=64
    )

    speculative_ngram_min: int = setting(
        1, "ngram: the shortest tail of the text looked up", group="speculative decoding", metavar="N", ge=1
    )

    speculative_ngram_max: int = setting(
        4,
        "ngram: the longest tail of the text looked up (the longest match wins)",
        group="speculative decoding",
        metavar="N",
        ge=1,
    )

    speculative_max_batch_size: int = setting(
        4,
        "speculate only while at most this many sequences run: a bigger batch is compute-bound, and the "
        "rejected tokens' work would cost more than the steps saved",
        group="speculative decoding",
        metavar="N",
        ge=1,
    )

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _parse_memory(cls, value: Any) -> Any:
        return parse_memory(value)

    @model_validator(mode="after")
    def _engine_config_valid(self) -> EngineSettings:
        try:
            self.engine_config()
        except ValueError as exc:
            raise ValueError(f"invalid engine setting: {exc}") from None
        return self

    def engine_config(self) -> EngineConfig:
        """The engine's configuration from these settings."""
        return EngineConfig(
            dtype=self.dtype,
            device=self.device,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            kv_cache_memory=self.kv_cache_memory,
            kv_cache_dtype=self.kv_cache_dtype,
            enable_prefix_caching=self.enable_prefix_caching,
            seed=self.seed,
            quantization=self.quantization,
            cpu_matmul=self.cpu_matmul,
            cuda_graphs=self.cuda_graphs,
            speculative_method=self.speculative_method,
            speculative_model=self.speculative_model,
            num_speculative_tokens=self.num_speculative_tokens,
            speculative_ngram_min=self.speculative_ngram_min,
            speculative_ngram_max=self.speculative_ngram_max,
            speculative_max_batch_size=self.speculative_max_batch_size,
        )

    @field_validator("speculative_model", mode="before")
    @classmethod
    def _none_text_model(cls, value: Any) -> Any:  # named apart from Settings' own (a same name would hide it)
        return none_text(value)
