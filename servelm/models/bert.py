"""A BERT-style encoder in plain PyTorch, loaded from a Hugging Face folder.

Post-LN transformer as in the original BERT: embeddings (word + position +
token type) then LayerNorm, and per layer self-attention and a GELU
feed-forward block, each followed by a residual add and LayerNorm. The
output is the last hidden state; pooling belongs to the caller.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

# Hugging Face names inside ``encoder.layer.N.`` -> our flat BertLayer names.
_LAYER_RENAMES = (
    ("attention.self.query.", "query."),
    ("attention.self.key.", "key."),
    ("attention.self.value.", "value."),
    ("attention.output.dense.", "attn_out."),
    ("attention.output.LayerNorm.", "attn_norm."),
    ("intermediate.dense.", "ffn_in."),
    ("output.dense.", "ffn_out."),
    ("output.LayerNorm.", "ffn_norm."),
)

_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


@dataclass(frozen=True)
class BertConfig:
    """The parts of a Hugging Face ``config.json`` that shape a BERT encoder."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0

    @classmethod
    def from_folder(cls, folder: str | Path) -> BertConfig:
        """Read ``config.json`` from a model folder, rejecting what this encoder cannot run."""
        raw = json.loads((Path(folder) / "config.json").read_text())
        position_type = raw.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(f"unsupported position_embedding_type {position_type!r}: only 'absolute'")
        config = cls(**{name: raw[name] for name in cls.__dataclass_fields__ if name in raw})
        if config.hidden_act not in _ACTIVATIONS:
            expected = ", ".join(_ACTIVATIONS)
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}: expected {expected}")
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(
                f"hidden_size {config.hidden_size} is not divisible by num_attention_heads {config.num_attention_heads}"
            )
        return config


class BertEmbeddings(nn.Module):
    """Token, position and token-type embeddings summed, then LayerNorm."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings(token_type_ids))


class BertLayer(nn.Module):
    """One post-LN encoder layer: attention, add & norm, feed-forward, add & norm."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.ffn_in = nn.Linear(hidden, config.intermediate_size)
        self.ffn_out = nn.Linear(config.intermediate_size, hidden)
        self.ffn_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        # "gelu" in BERT configs is the exact erf form; the others are the tanh approximation.
        self.act = (
            nn.ReLU()
            if config.hidden_act == "relu"
            else nn.GELU(approximate="none" if config.hidden_act == "gelu" else "tanh")
        )

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        """``x`` is [batch, seq, hidden]; ``attn_mask`` is [batch, 1, 1, seq], True where a key is real."""
        batch, seq, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, self.num_heads, hidden // self.num_heads).transpose(1, 2)

        attn = F.scaled_dot_product_attention(
            heads(self.query(x)), heads(self.key(x)), heads(self.value(x)), attn_mask=attn_mask
        )
        x = self.attn_norm(x + self.attn_out(attn.transpose(1, 2).reshape(batch, seq, hidden)))
        return self.ffn_norm(x + self.ffn_out(self.act(self.ffn_in(x))))


class BertEncoder(nn.Module):
    """The stack of encoder layers."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, attn_mask)
        return x


class BertModel(nn.Module):
    """A BERT encoder returning the last hidden state (no pooler head)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Encode [batch, seq] token ids; ``attention_mask`` is 1 for real tokens, 0 for padding.

        Returns the last hidden state, [batch, seq, hidden]. Rows at padding
        positions hold values but mean nothing; pool with the mask.
        """
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence of {input_ids.shape[1]} tokens is longer than the model's "
                f"{self.config.max_position_embeddings} positions"
            )
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        # Only keys are masked: padded queries still see the real tokens, so no
        # row is all -inf and SDPA never produces NaN.
        attn_mask = attention_mask.bool()[:, None, None, :]
        return self.encoder(self.embeddings(input_ids, token_type_ids), attn_mask)

    @classmethod
    def from_pretrained(
        cls, folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> BertModel:
        """Build the encoder from ``config.json`` and the folder's ``*.safetensors`` weights."""
        folder = Path(folder)
        config = BertConfig.from_folder(folder)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {folder}")
        checkpoint: dict[str, torch.Tensor] = {}
        for file in files:
            checkpoint.update(load_file(str(file)))
        # Built on the meta device so no memory is spent on random weights
        # that the checkpoint replaces at once.
        with torch.device("meta"):
            model = cls(config)
        state = _rename_checkpoint(checkpoint, set(model.state_dict()))
        missing = sorted(set(model.state_dict()) - set(state))
        if missing:
            shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
            raise ValueError(f"{folder}: weights missing from the checkpoint: {shown}")
        model.load_state_dict(state, strict=True, assign=True)
        return model.to(device=device, dtype=dtype).eval()


def _rename_checkpoint(checkpoint: dict[str, torch.Tensor], wanted: set[str]) -> dict[str, torch.Tensor]:
    """Map Hugging Face tensor names onto ours, keeping only the ones the encoder uses.

    Task heads (``cls.``, ``pooler.``, classifiers) and buffers such as
    ``position_ids`` are dropped: an embedding server needs none of them.
    """
    state: dict[str, torch.Tensor] = {}
    for name, tensor in checkpoint.items():
        # BertFor* checkpoints nest the encoder under "bert.".
        name = name.removeprefix("bert.")
        # Checkpoints converted from TensorFlow name LayerNorm parameters gamma/beta.
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if name.startswith("encoder.layer."):
            index, rest = name.removeprefix("encoder.layer.").split(".", 1)
            for old, new in _LAYER_RENAMES:
                if rest.startswith(old):
                    name = f"encoder.layer.{index}.{new}{rest.removeprefix(old)}"
                    break
        if name in wanted:
            state[name] = tensor
    return state
