"""EmbeddingEngine against the sentence-transformers recipe done by hand with transformers."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from servelm.engine.embedding_engine import EmbeddingEngine
from servelm.models.registry import ModelPathError, resolve_model_path

pytestmark = pytest.mark.model

TEXTS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "Hi",
    "A man is riding a white horse on an enclosed ground, while the crowd cheers loudly behind the fence.",
]


@pytest.fixture(scope="module")
def folder() -> Path:
    return resolve_model_path("all-minilm-l6-v2")


@pytest.fixture(scope="module")
def engine() -> EmbeddingEngine:
    return EmbeddingEngine("all-minilm-l6-v2")


@pytest.fixture(scope="module")
def reference_hidden(folder: Path):
    """Last hidden states and masks from transformers, one text at a time (no padding)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = transformers.BertModel.from_pretrained(str(folder), local_files_only=True).eval()

    def run(texts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        with torch.inference_mode():
            for text in texts:
                batch = tokenizer(text, return_tensors="pt")
                out.append((model(**batch).last_hidden_state, batch["attention_mask"]))
        return out

    return run


def _cosine(a: list[float], b: list[float]) -> float:
    return F.cosine_similarity(torch.tensor([a]), torch.tensor([b])).item()


def test_matches_sentence_transformers_recipe(engine, reference_hidden):
    outputs = engine.embed(TEXTS)
    for out, (hidden, mask) in zip(outputs, reference_hidden(TEXTS)):
        weights = mask.unsqueeze(-1).float()
        mean = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        want = F.normalize(mean, p=2, dim=1)[0].tolist()
        assert _cosine(out.embedding, want) > 1 - 1e-5
        torch.testing.assert_close(torch.tensor(out.embedding), torch.tensor(want), atol=1e-5, rtol=0)


def test_shape_norm_and_token_counts(engine):
    assert engine.dimensions == 384
    assert engine.max_model_len == 256
    assert engine.name == "all-minilm-l6-v2"
    for text, out in zip(TEXTS, engine.embed(TEXTS)):
        assert len(out.embedding) == 384
        assert all(isinstance(x, float) for x in out.embedding)
        assert math.isclose(math.hypot(*out.embedding), 1.0, abs_tol=1e-5)
        assert out.num_tokens == len(engine.tokenize(text))


def test_tokenize_adds_special_tokens(engine):
    ids = engine.tokenize("hello world")
    assert ids[0] == engine.tokenizer.cls_token_id
    assert ids[-1] == engine.tokenizer.sep_token_id
    assert len(ids) == 4


def test_mixed_length_batch_equals_one_at_a_time():
    # A batch size of 2 forces several padded chunks out of five inputs.
    small_batches = EmbeddingEngine("all-minilm-l6-v2", max_batch_size=2)
    batched = small_batches.embed(TEXTS)
    assert len(batched) == len(TEXTS)
    for text, out in zip(TEXTS, batched):
        (single,) = small_batches.embed([text])
        assert single.num_tokens == out.num_tokens
        torch.testing.assert_close(torch.tensor(out.embedding), torch.tensor(single.embedding), atol=1e-5, rtol=0)


def test_semantic_sanity(engine):
    food, bread, baby = (out.embedding for out in engine.embed(TEXTS[:3]))
    assert _cosine(food, bread) > _cosine(food, baby) + 0.2


def test_token_ids_equal_text(engine):
    ids = [engine.tokenize(text) for text in TEXTS[:2]]
    from_ids = engine.embed(ids)
    from_text = engine.embed(TEXTS[:2])
    for a, b in zip(from_ids, from_text):
        assert a.num_tokens == b.num_tokens
        torch.testing.assert_close(torch.tensor(a.embedding), torch.tensor(b.embedding), atol=1e-6, rtol=0)


def test_token_ids_are_used_as_given(engine):
    ids = engine.tokenize("A man is eating food.")
    bare = ids[1:-1]  # without [CLS] and [SEP]: nothing must add them back
    (out,) = engine.embed([bare])
    assert out.num_tokens == len(bare)
    (with_special,) = engine.embed([ids])
    assert _cosine(out.embedding, with_special.embedding) < 1 - 1e-3


def test_too_long_input_names_both_numbers(engine):
    text = "word " * 300
    n = len(engine.tokenize(text))
    assert n > 256
    with pytest.raises(ValueError, match=rf"input 1 has {n} tokens.*maximum of 256"):
        engine.embed(["fine", text])
    with pytest.raises(ValueError, match=r"257 tokens.*256"):
        engine.embed([[101] * 257])


def test_bad_token_ids_are_value_errors(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.embed([[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.embed([[101, 30522, 102]])
    with pytest.raises(ValueError, match="string or a list of token ids"):
        engine.embed([[101, "x"]])


def test_empty_input_list_gives_no_outputs(engine):
    assert engine.embed([]) == []


def test_missing_model_path_gives_registry_error(tmp_path):
    with pytest.raises(ModelPathError, match="no such file or folder"):
        EmbeddingEngine(str(tmp_path / "nowhere"))


def test_cls_pooling_without_normalize(folder, tmp_path, reference_hidden):
    for item in folder.iterdir():
        if item.name not in ("1_Pooling", "modules.json"):
            (tmp_path / item.name).symlink_to(item)
    (tmp_path / "1_Pooling").mkdir()
    pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
    pooling.update(pooling_mode_cls_token=True, pooling_mode_mean_tokens=False)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    modules = json.loads((folder / "modules.json").read_text())
    modules = [m for m in modules if not m["type"].endswith("Normalize")]
    (tmp_path / "modules.json").write_text(json.dumps(modules))

    (out,) = EmbeddingEngine(str(tmp_path)).embed([TEXTS[0]])
    ((hidden, _),) = reference_hidden([TEXTS[0]])
    torch.testing.assert_close(torch.tensor(out.embedding), hidden[0, 0], atol=1e-4, rtol=1e-4)
    assert abs(math.hypot(*out.embedding) - 1.0) > 0.1


def test_plain_folder_defaults_to_normalised_mean(folder, tmp_path, engine):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        (tmp_path / name).symlink_to(folder / name)
    plain = EmbeddingEngine(str(tmp_path))
    assert plain.max_model_len == 512
    (got,) = plain.embed([TEXTS[0]])
    (want,) = engine.embed([TEXTS[0]])
    torch.testing.assert_close(torch.tensor(got.embedding), torch.tensor(want.embedding), atol=1e-6, rtol=0)


def test_sub_batches_keep_within_both_limits(engine, monkeypatch):
    lengths = [3, 250, 7, 7, 64, 128, 5, 200, 31, 7, 7]
    token_ids = [[101] * n for n in lengths]
    monkeypatch.setattr(engine, "max_batch_size", 3)
    monkeypatch.setattr(engine, "max_batch_tokens", 100)
    batches = engine._sub_batches(token_ids)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))  # each input once
    runs = [lengths[i] for batch in batches for i in batch]
    assert runs == sorted(runs)  # similar lengths together
    for batch in batches:
        assert len(batch) <= 3
        # Rows times the longest row; an input longer than the limit runs alone.
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 100
    assert [len(batch) for batch in batches] == [3, 3, 1, 1, 1, 1, 1]


def test_sub_batches_by_tokens_give_the_same_embeddings(engine, monkeypatch):
    whole = engine.embed(TEXTS)
    monkeypatch.setattr(engine, "max_batch_tokens", 24)  # several sub-batches, the longest text alone
    assert len(engine._sub_batches([engine.tokenize(text) for text in TEXTS])) > 2
    for got, want in zip(engine.embed(TEXTS), whole):
        assert got.num_tokens == want.num_tokens
        torch.testing.assert_close(torch.tensor(got.embedding), torch.tensor(want.embedding), atol=1e-5, rtol=0)


def test_each_sub_batch_runs_in_a_turn_and_a_turn_can_stop_the_call(engine, monkeypatch):
    monkeypatch.setattr(engine, "max_batch_size", 2)
    turns: list[str] = []

    @contextlib.contextmanager
    def turn():
        turns.append("in")
        yield
        turns.append("out")

    assert len(engine.embed(TEXTS, batch_turn=turn)) == len(TEXTS)
    assert turns == ["in", "out"] * 3

    class Stop(Exception):
        pass

    def stop():
        raise Stop

    with pytest.raises(Stop):
        engine.embed(TEXTS, batch_turn=stop)


def test_tokenize_without_special_tokens_and_detokenize(engine):
    assert engine.tokenize("hello", add_special_tokens=False) == [7592]
    assert engine.detokenize(engine.tokenize("hello world")) == "[CLS] hello world [SEP]"
    assert engine.vocab_size == 30522
