"""The shape of a Llama-family model, read from a HF config.json or GGUF metadata.

Kept free of torch so that anything may import it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# HF architecture name -> (HF model_type, GGUF general.architecture)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "llama"),
    "MistralForCausalLM": ("mistral", "llama"),  # llama.cpp stores Mistral as llama
    "Qwen2ForCausalLM": ("qwen2", "qwen2"),
    "Qwen3ForCausalLM": ("qwen3", "qwen3"),
}
_BY_MODEL_TYPE = {model_type: arch for arch, (model_type, _) in SUPPORTED_ARCHITECTURES.items()}
_BY_GGUF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this package cannot run."""


@dataclass
class ModelConfig:
    """Everything the model code needs to know about one checkpoint."""

    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None for plain RoPE; else {"rope_type": "linear" | "llama3", ...its parameters}
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (always on for Qwen2)
    attention_out_bias: bool = False  # bias on o_proj (Llama/Qwen3 attention_bias=True)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None = None  # Mistral v0.1; we cap the context instead of windowing
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedModelError(
                    f"unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                )

    @property
    def max_model_len(self) -> int:
        """Longest context the model runs correctly: a sliding window caps it, since we attend to all."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from the dict of a HF ``config.json`` (transformers 4 or 5 rope layout)."""
        architecture = _hf_architecture(d)
        num_heads = d["num_attention_heads"]
        model_type = SUPPORTED_ARCHITECTURES[architecture][0]
        if d.get("mlp_bias"):
            raise UnsupportedModelError(f"{architecture} with mlp_bias=True is not supported")
        rope_theta, rope_scaling = _hf_rope(d)
        bias = bool(d.get("attention_bias", False))
        sliding_window = d.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
            sliding_window = None  # Qwen configs carry a window they do not use
        return cls(
            architecture=architecture,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bias or model_type == "qwen2",
            attention_out_bias=bias and model_type != "qwen2",
            qk_norm=model_type == "qwen3",
            sliding_window=sliding_window,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_as_id_list(d.get("eos_token_id")),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        """Build from GGUF key/value metadata (scalars already decoded) and the file's tensor names.

        ``{arch}.vocab_size`` is optional in GGUF files; the loader fills it in from
        the embedding's shape when missing.
        """
        gguf_arch = meta.get("general.architecture")
        if gguf_arch not in _BY_GGUF_ARCH:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture {gguf_arch!r}; supported: {', '.join(_BY_GGUF_ARCH)}"
            )

        def key(name: str, default: Any = None) -> Any:
            value = meta.get(f"{gguf_arch}.{name}", default)
            if value is None:
                raise UnsupportedModelError(f"GGUF metadata lacks {gguf_arch}.{name}")
            return value

        hidden = key("embedding_length")
        num_heads = key("attention.head_count")
        eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
        return cls(
            architecture=_BY_GGUF_ARCH[gguf_arch],
            vocab_size=key("vocab_size"),
            hidden_size=hidden,
            intermediate_size=key("feed_forward_length"),
            num_hidden_layers=key("block_count"),
            num_attention_heads=num_heads,
            num_key_value_heads=key("attention.head_count_kv", num_heads),
            head_dim=key("attention.key_length", hidden // num_heads),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope(meta, gguf_arch),
            max_position_embeddings=key("context_length", 2048),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            attention_out_bias="blk.0.attn_output.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=list(dict.fromkeys(int(i) for i in eos)),
        )


def _hf_architecture(d: dict[str, Any]) -> str:
    names = d.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    if not names and d.get("model_type") in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[d["model_type"]]
    named = ", ".join(names) or f"model_type {d.get('model_type')!r}"
    raise UnsupportedModelError(f"unsupported architecture {named}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _hf_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either ``rope_theta``+``rope_scaling`` or ``rope_parameters``."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
    # Old configs spell it "type"; transformers 5 writes "rope_type".
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **params}


def _gguf_rope(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    # Llama 3.1-style scaling arrives as a rope_freqs tensor, which the GGUF loader applies.
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling in (None, "none"):
        return None
    if scaling == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    raise UnsupportedModelError(f"unsupported GGUF rope scaling {scaling!r}")


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]
