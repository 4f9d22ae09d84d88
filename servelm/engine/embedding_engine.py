"""Sentence embeddings from a BERT-style encoder.

Pooling and normalisation follow the folder's sentence-transformers files
(``modules.json``, ``1_Pooling/config.json``, ``sentence_bert_config.json``)
so the vectors match what ``SentenceTransformer(folder).encode`` gives.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from servelm.engine.device import resolve_device, resolve_dtype
from servelm.engine.outputs import EmbeddingOutput
from servelm.engine.vocabulary import vocabulary_error
from servelm.models.bert import BertModel
from servelm.models.registry import resolve_model_path

# Pooling mode -> its switch in 1_Pooling/config.json.
_POOLING_KEYS = (
    ("cls", "pooling_mode_cls_token"),
    ("mean", "pooling_mode_mean_tokens"),
    ("max", "pooling_mode_max_tokens"),
    ("mean_sqrt_len", "pooling_mode_mean_sqrt_len_tokens"),
)


class InputTooLongError(ValueError):
    """An input with more tokens than the encoder's context."""


@dataclass(frozen=True)
class SentenceConfig:
    """How hidden states become one vector: the sentence-transformers recipe of a folder."""

    model_folder: Path  # where config.json and the weights are (modules.json may point to a subfolder)
    pooling: str = "mean"
    normalize: bool = True
    max_seq_length: int | None = None

    @classmethod
    def from_folder(cls, folder: Path) -> SentenceConfig:
        """Read the recipe; a plain Hugging Face folder gets mean pooling and normalisation.

        The default normalises because the API promises unit vectors (as
        OpenAI's embeddings are) whatever the folder's pedigree.
        """
        modules_file = folder / "modules.json"
        if not modules_file.exists():
            return cls(model_folder=folder, max_seq_length=_read_max_seq_length(folder))
        modules = json.loads(modules_file.read_text())
        by_kind = {m["type"].rsplit(".", 1)[-1]: folder / m.get("path", "") for m in modules}
        model_folder = by_kind.get("Transformer", folder)
        pooling = "mean"
        if "Pooling" in by_kind:
            pooling = _read_pooling_mode(by_kind["Pooling"] / "config.json")
        return cls(
            model_folder=model_folder,
            pooling=pooling,
            normalize="Normalize" in by_kind,
            max_seq_length=_read_max_seq_length(model_folder) or _read_max_seq_length(folder),
        )


class EmbeddingEngine:
    """Loads an encoder and turns texts or token id lists into normalised sentence embeddings."""

    def __init__(
        self,
        name_or_path: str,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        max_batch_size: int = 32,
        max_batch_tokens: int = 2048,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.name = name_or_path
        folder = resolve_model_path(name_or_path)
        if not folder.is_dir():
            raise ValueError(f"embedding model {name_or_path!r}: {folder} is not a model folder")
        self.sentence_config = SentenceConfig.from_folder(folder)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        model_folder = self.sentence_config.model_folder
        self.model = BertModel.from_pretrained(model_folder, dtype=self.dtype, device=self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_folder), local_files_only=True)
        config = self.model.config
        self.dimensions: int = config.hidden_size
        max_len = self.sentence_config.max_seq_length or config.max_position_embeddings
        self.max_model_len: int = min(max_len, config.max_position_embeddings)
        pad_id = self.tokenizer.pad_token_id
        self.pad_token_id: int = config.pad_token_id if pad_id is None else pad_id

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to ``vocab_size - 1``."""
        return int(self.model.config.vocab_size)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, by default with the special tokens the model expects ([CLS] ... [SEP])."""
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens included (ids are not checked: see :attr:`vocab_size`)."""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=False))

    def embed(
        self,
        inputs: list[str] | list[list[int]],
        batch_turn: Callable[[], AbstractContextManager[object]] = nullcontext,
    ) -> list[EmbeddingOutput]:
        """One embedding per input, in input order.

        Strings are tokenised with special tokens; token id lists are used as
        given. Every input is checked before any is run, so a bad one fails
        the whole call with a ValueError and no work is wasted.

        The inputs run in sub-batches (see :meth:`_sub_batches`), each inside
        ``batch_turn()``: a caller that shares the encoder takes turns there
        with other calls, and stops this one by raising from it.
        """
        token_ids = self._to_token_ids(inputs)
        for i, ids in enumerate(token_ids):
            self._check(i, ids)
        results: list[EmbeddingOutput | None] = [None] * len(token_ids)
        for chunk in self._sub_batches(token_ids):
            with batch_turn():
                vectors = self._embed_batch([token_ids[i] for i in chunk])
            for i, vector in zip(chunk, vectors):
                results[i] = EmbeddingOutput(embedding=vector, num_tokens=len(token_ids[i]))
        return results  # type: ignore[return-value]  # every slot was filled above

    def _sub_batches(self, token_ids: list[list[int]]) -> list[list[int]]:
        """Input indices in sub-batches of similar lengths, each within both batch limits.

        Similar lengths waste less compute on padding. The token limit (rows
        times the longest row, padding included) bounds how long one
        sub-batch runs, so that callers taking turns wait about as long for
        long inputs as for short ones; on a CPU the encoder runs no faster
        in bigger batches than the default's.
        """
        order = sorted(range(len(token_ids)), key=lambda i: len(token_ids[i]))
        batches: list[list[int]] = []
        for i in order:
            # Sorted by length, so input i would be the longest row of the last batch.
            last = batches[-1] if batches else []
            if (
                last
                and len(last) < self.max_batch_size
                and (len(last) + 1) * len(token_ids[i]) <= self.max_batch_tokens
            ):
                last.append(i)
            else:
                batches.append([i])
        return batches

    def _to_token_ids(self, inputs: list[str] | list[list[int]]) -> list[list[int]]:
        texts = [x for x in inputs if isinstance(x, str)]
        # One call for all texts: the fast tokenizer batches them in Rust.
        encoded = iter(self.tokenizer(texts, add_special_tokens=True)["input_ids"] if texts else ())
        return [list(next(encoded)) if isinstance(x, str) else x for x in inputs]

    def _check(self, index: int, ids: object) -> None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"input {index} must be a string or a list of token ids")
        if not ids:
            raise ValueError(f"input {index} is empty")
        if len(ids) > self.max_model_len:
            raise InputTooLongError(
                f"input {index} has {len(ids)} tokens, more than this model's maximum of {self.max_model_len} tokens"
            )
        outside = vocabulary_error(ids, self.model.config.vocab_size)
        if outside is not None:
            raise ValueError(f"input {index}: {outside}")

    @torch.inference_mode()
    def _embed_batch(self, batch: list[list[int]]) -> list[list[float]]:
        longest = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, : len(ids)] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        # Pool in float32 so half-precision models lose nothing to the sums.
        hidden = self.model(input_ids, mask).float()
        pooled = _pool(hidden, mask, self.sentence_config.pooling)
        if self.sentence_config.normalize:
            pooled = F.normalize(pooled, p=2, dim=-1)
        return pooled.cpu().tolist()


def _pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce [batch, seq, hidden] to [batch, hidden] over the real tokens only."""
    if mode == "cls":
        return hidden[:, 0]
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "max":
        return hidden.masked_fill(weights == 0, float("-inf")).max(dim=1).values
    # Clamped as sentence-transformers does, though _check already rules out empty inputs.
    counts = weights.sum(dim=1).clamp(min=1e-9)
    summed = (hidden * weights).sum(dim=1)
    return summed / (counts.sqrt() if mode == "mean_sqrt_len" else counts)


def _read_pooling_mode(path: Path) -> str:
    raw = json.loads(path.read_text())
    modes = [mode for mode, key in _POOLING_KEYS if raw.get(key)]
    if len(modes) != 1:
        enabled = [key for key, value in raw.items() if key.startswith("pooling_mode") and value]
        supported = ", ".join(key for _, key in _POOLING_KEYS)
        raise ValueError(f"{path}: need exactly one of {supported}; enabled: {enabled or 'none'}")
    return modes[0]


def _read_max_seq_length(folder: Path) -> int | None:
    path = folder / "sentence_bert_config.json"
    if not path.exists():
        return None
    value = json.loads(path.read_text()).get("max_seq_length")
    return None if value is None else int(value)
