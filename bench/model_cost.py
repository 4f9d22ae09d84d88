"""What serving a model costs, from its Hugging Face config: FLOPs per request, bytes per decoding step.

bench/compare_table.py divides these by a level's measured times to get each
server's achieved FLOP/s and bytes/s, then by the machine's limits
(bench/machine_limits.py). Pure arithmetic, standard library only.

What is counted (the usual roofline conventions):

- FLOPs: a multiply-add is 2. The matmuls of every layer (q, k, v, o, gate,
  up, down) run once for every prompt token and every generated token but the
  last (it is sampled, never fed back); the LM head (vocabulary x hidden) once
  per generated token, since servers compute logits only at a prompt's last
  position; attention's two products (Q.K and weights.V) cost
  ``2 * 2 * heads * head_dim`` per layer for each key a token sees, and a
  token at position i sees i keys (causal). Norms, RoPE, activations and
  softmax are left out (well under 1% at these shapes). This is the work the
  model needs; a prefix-cache hit skips some of it, so a server that caches
  shows a little more than it computed.
- Bytes of a decoding step: every matmul weight once (the server's weight
  format decides the bytes per weight) plus the K and V of every token of
  every running sequence (a 16-bit cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Bytes per weight of the formats the compared servers use. Q8_0 is llama.cpp's
# blocks of 32 int8 weights with a float16 scale; servelm's int8 has one scale
# per output row (negligible), as w8a8 has.
WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "f16": 2.0, "int8": 1.0, "w8a8": 1.0, "q8_0": 34 / 32}
KV_BYTES = 2  # bfloat16 or float16 K/V cache


@dataclass(frozen=True)
class ModelCost:
    """The dimensions that set a decoder's cost."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelCost:
        """From a ``config.json`` of the Llama family (Llama, Qwen2, Mistral, SmolLM)."""
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        return cls(
            layers=config["num_hidden_layers"],
            hidden=hidden,
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            intermediate=config["intermediate_size"],
            vocab=config["vocab_size"],
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama-style configs say so with attention_bias.
            qkv_bias=config.get("model_type") == "qwen2" or bool(config.get("attention_bias", False)),
        )

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one layer's matmuls: q and o (heads), k and v (KV heads), gate, up and down."""
        q = self.hidden * self.heads * self.head_dim
        kv = self.hidden * self.kv_heads * self.head_dim
        return 2 * q + 2 * kv + 3 * self.hidden * self.intermediate

    @property
    def body_params(self) -> int:
        """Matmul weights of all layers (what every token in the model multiplies by)."""
        return self.layers * self.layer_matmul_params

    @property
    def head_params(self) -> int:
        """The LM head's weights (the embedding itself when tied)."""
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """All parameters, as the checkpoint counts them (norms, biases, an untied embedding)."""
        per_layer = self.layer_matmul_params + 2 * self.hidden  # + two RMSNorm weights
        if self.qkv_bias:
            per_layer += (self.heads + 2 * self.kv_heads) * self.head_dim
        embedding = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.layers * per_layer + self.head_params + embedding + self.hidden  # + the final norm

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, in a 16-bit cache."""
        return self.layers * 2 * self.kv_heads * self.head_dim * KV_BYTES

    @property
    def kv_int8_bytes_per_token(self) -> int:
        """K and V of one token over all layers in servelm's int8 cache: a float32 scale beside each row."""
        return self.layers * 2 * self.kv_heads * (self.head_dim + 4)

    def attention_flops(self, keys: int) -> int:
        """FLOPs of one token's attention over ``keys`` keys, all layers (Q.K and weights.V)."""
        return self.layers * 2 * 2 * self.heads * self.head_dim * keys

    def request_flops(self, prompt_tokens: float, output_tokens: float) -> float:
        """FLOPs of one request: ``prompt_tokens`` prefilled, ``output_tokens`` generated.

        Fractional token counts (a level's means) are fine: the formula is
        smooth in both.
        """
        if output_tokens < 1:
            return 0.0
        fed = prompt_tokens + output_tokens - 1  # tokens that go through the layers
        # A token at position i (1-based) attends over i keys: sum of i for i = 1..fed.
        attention = self.attention_flops(1) * fed * (fed + 1) / 2
        return 2 * self.body_params * fed + 2 * self.head_params * output_tokens + attention

    def decode_step_bytes(self, batch: float, context: float, weight_format: str, kv_int8: bool = False) -> float:
        """Bytes one decoding step reads: every matmul weight once, and ``batch`` sequences' K/V of ``context`` tokens
        (in a 16-bit cache, or an int8 one)."""
        weights = (self.body_params + self.head_params) * WEIGHT_BYTES[weight_format]
        return weights + batch * context * (self.kv_int8_bytes_per_token if kv_int8 else self.kv_bytes_per_token)


def flops_per_second(
    cost: ModelCost, completed: int, prompt_tokens: int, output_tokens: int, duration_s: float
) -> float | None:
    """Achieved FLOP/s of a level: ``completed`` requests of these token totals in ``duration_s`` of wall time.

    Requests are taken as alike (each the level's mean prompt and output): the
    benchmark's prompts differ by a few tokens at most. None without a
    completed request or a duration.
    """
    if completed <= 0 or duration_s <= 0:
        return None
    return completed * cost.request_flops(prompt_tokens / completed, output_tokens / completed) / duration_s


def decode_bytes_per_second(
    cost: ModelCost,
    batch: int,
    prompt_mean: float,
    output_mean: float,
    step_s: float,
    weight_format: str,
    kv_int8: bool = False,
) -> float | None:
    """Achieved bytes/s while decoding: one step's bytes over one step's time.

    ``step_s`` is the time per output token of a request (its TPOT): each step
    gives every running sequence one token. The context is the middle of the
    decode (prompt plus half the output), ``batch`` sequences run together.
    None when there is no step time.
    """
    if step_s <= 0:
        return None
    return cost.decode_step_bytes(batch, prompt_mean + output_mean / 2, weight_format, kv_int8) / step_s
