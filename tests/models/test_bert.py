"""Our BERT encoder against transformers' on the bundled MiniLM weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from servelm.models.bert import BertConfig, BertModel
from servelm.models.registry import resolve_model_path

pytestmark = pytest.mark.model

TEXTS = [
    "Hi",
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog, then naps under a tree for the afternoon.",
]


@pytest.fixture(scope="module")
def folder() -> Path:
    return resolve_model_path("all-minilm-l6-v2")


@pytest.fixture(scope="module")
def ours(folder: Path) -> BertModel:
    return BertModel.from_pretrained(folder)


@pytest.fixture(scope="module")
def reference(folder: Path) -> transformers.BertModel:
    return transformers.BertModel.from_pretrained(str(folder), local_files_only=True).eval()


@pytest.fixture(scope="module")
def tokenizer(folder: Path):
    return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _assert_same_hidden(ours: BertModel, reference: transformers.BertModel, batch) -> None:
    with torch.inference_mode():
        got = ours(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
        want = reference(**batch).last_hidden_state
    real = batch["attention_mask"].bool()
    assert got.shape == want.shape
    # Padding rows are meaningless in both models; only real tokens must agree.
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-4)


def test_last_hidden_state_matches_transformers_with_padding(ours, reference, tokenizer):
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any(), "the batch must contain padding"
    _assert_same_hidden(ours, reference, batch)


def test_token_type_ids_match_transformers(ours, reference, tokenizer):
    questions, answers = ["what is a fox?", "hi"], ["a small wild dog", "hello there my friend"]
    batch = tokenizer(questions, answers, padding=True, return_tensors="pt")
    assert (batch["token_type_ids"] == 1).any()
    _assert_same_hidden(ours, reference, batch)


def test_padding_does_not_change_real_tokens(ours, tokenizer):
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    alone = tokenizer(TEXTS[0], return_tensors="pt")
    with torch.inference_mode():
        padded = ours(batch["input_ids"], batch["attention_mask"])
        single = ours(alone["input_ids"], alone["attention_mask"])
    n = alone["input_ids"].shape[1]
    torch.testing.assert_close(padded[0, :n], single[0], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(padded).all()


def test_bert_prefixed_checkpoint_loads_the_same(folder, ours, tokenizer, tmp_path):
    checkpoint = load_file(str(folder / "model.safetensors"))
    prefixed = {f"bert.{name}": tensor for name, tensor in checkpoint.items()}
    prefixed["cls.predictions.bias"] = torch.zeros(3)  # a task head the encoder must ignore
    save_file(prefixed, str(tmp_path / "model.safetensors"))
    shutil.copy(folder / "config.json", tmp_path / "config.json")

    loaded = BertModel.from_pretrained(tmp_path)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.inference_mode():
        torch.testing.assert_close(
            loaded(batch["input_ids"], batch["attention_mask"]),
            ours(batch["input_ids"], batch["attention_mask"]),
            atol=0,
            rtol=0,
        )


def test_missing_weight_is_named(folder, tmp_path):
    checkpoint = load_file(str(folder / "model.safetensors"))
    del checkpoint["encoder.layer.3.intermediate.dense.weight"]
    save_file(checkpoint, str(tmp_path / "model.safetensors"))
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"encoder\.layer\.3\.ffn_in\.weight"):
        BertModel.from_pretrained(tmp_path)


def test_config_rejects_relative_positions(folder, tmp_path):
    raw = json.loads((folder / "config.json").read_text())
    raw["position_embedding_type"] = "relative_key"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="relative_key"):
        BertConfig.from_folder(tmp_path)


def test_too_long_sequence_is_refused(ours):
    ids = torch.ones((1, ours.config.max_position_embeddings + 1), dtype=torch.long)
    with pytest.raises(ValueError, match="513 tokens"):
        ours(ids)
