"""Engine configuration: limits and memory of one engine instance."""

from __future__ import annotations

from dataclasses import dataclass

# none; int8: weight-only (servelm/models/quantization.py); w8a8: int8 weights and activations
# (servelm/models/w8a8.py). Both CPU only.
QUANTIZATIONS = ("none", "int8", "w8a8")
# The KV cache's dtype: auto, the model's; int8, rows rounded to int8 with a scale each (engine/kv_cache.py).
KV_CACHE_DTYPES = ("auto", "int8")


@dataclass
class EngineConfig:
    """Knobs of the serving engine.

    ``kv_cache_memory`` sizes the paged KV cache: an int is bytes, a float in
    (0, 1] is a fraction of the device's free memory (on CPU, of available
    RAM) at start-up.
    """

    dtype: str = "auto"  # float32, bfloat16, float16 or auto (see engine.device.resolve_dtype)
    device: str = "auto"  # cpu, cuda, cuda:N or auto
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's own context length
    kv_cache_memory: int | float = 1 << 30
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    enable_prefix_caching: bool = True
    seed: int = 0
    quantization: str = "none"  # one of QUANTIZATIONS
    cpu_matmul: str = "auto"  # auto, onednn or pairs: decoding's small bf16 matmuls on CPU, see models/packed.py
    cuda_graphs: bool = True  # on CUDA, replay decoding steps as CUDA graphs (engine/cuda_graphs.py)
    # Speculative decoding (servelm/engine/spec_decode): none, ngram (prompt lookup) or draft (a smaller
    # model with the same tokenizer, speculative_model). Each step proposes up to num_speculative_tokens
    # tokens per decoding sequence, only while at most speculative_max_batch_size sequences run.
    speculative_method: str = "none"
    speculative_model: str | None = None
    num_speculative_tokens: int = 4
    speculative_ngram_min: int = 1
    speculative_ngram_max: int = 4
    speculative_max_batch_size: int = 4

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if isinstance(self.kv_cache_memory, float) and not 0.0 < self.kv_cache_memory <= 1.0:
            raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {self.kv_cache_memory}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.cpu_matmul not in ("auto", "onednn", "pairs"):
            raise ValueError(f"cpu_matmul must be auto, onednn or pairs, got {self.cpu_matmul!r}")
        if isinstance(self.kv_cache_memory, int) and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory in bytes must be > 0, got {self.kv_cache_memory}")
        self._check_speculative()

    def _check_speculative(self) -> None:
        if self.speculative_method not in ("none", "ngram", "draft"):
            raise ValueError(f"speculative_method must be none, ngram or draft, got {self.speculative_method!r}")
        if (self.speculative_method == "draft") != (self.speculative_model is not None):
            raise ValueError("speculative_model names the draft model of speculative_method draft, and only of it")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ValueError(
                "need 1 <= speculative_ngram_min <= speculative_ngram_max, got "
                f"{self.speculative_ngram_min} and {self.speculative_ngram_max}"
            )
        if self.speculative_max_batch_size < 1:
            raise ValueError(f"speculative_max_batch_size must be >= 1, got {self.speculative_max_batch_size}")

    @property
    def speculative(self) -> bool:
        """True when the engine proposes tokens (speculative_method is not none)."""
        return self.speculative_method != "none"
