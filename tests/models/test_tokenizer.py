"""The tokenizer wrapper, on the bundled GGUF's tokenizer and on a HF tokenizer folder."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from servelm.models.tokenizer import Tokenizer, load_tokenizer
from servelm.platform.cache import STALE_SECONDS

TEXTS = [
    "Hello, world!",
    "  leading spaces, tabs\tand\nnewlines  ",
    "café, naïve, 日本語, emoji 😀",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def gguf_tokenizer(model_path) -> Tokenizer:
    return load_tokenizer(model_path, eos_token_ids=[2], max_model_len=8192)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(gguf_tokenizer, text):
    ids = gguf_tokenizer.encode(text)
    assert gguf_tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.model
def test_same_ids_as_transformers_auto_tokenizer(gguf_tokenizer, hf_model):
    """We skip AutoTokenizer for GGUF files (it is slow); the result must not differ."""
    _, reference = hf_model
    for text in TEXTS:
        assert gguf_tokenizer.encode(text) == reference.encode(text)


def test_special_tokens_and_sizes(gguf_tokenizer):
    tok = gguf_tokenizer
    assert tok.eos_token_ids == {2}
    assert tok.convert_ids_to_tokens([2]) == ["<|im_end|>"]
    assert tok.bos_token_id == 1
    assert tok.pad_token_id == 2
    assert tok.vocab_size == 49152
    assert tok.max_model_len == 8192
    # SmolLM2 adds no BOS; special-token text maps to its id.
    assert tok.encode("<|im_start|>") == [1]
    assert tok.decode([1, *tok.encode("hi"), 2]) == "hi"


def test_chatml_template(gguf_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    prompt = gguf_tokenizer.apply_chat_template(messages)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert no_prompt.endswith("Hi there<|im_end|>\n")


def test_template_override(gguf_tokenizer):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{{ suffix }}"
    out = gguf_tokenizer.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template, suffix="!")
    assert out == "[user] x\n!"


def test_hf_folder_tokenizer(tokenizer_dir, tmp_path):
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = load_tokenizer(tmp_path, eos_token_ids=[7])
    assert tok.eos_token_ids == {0, 2, 7}
    assert tok.chat_template is not None
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]).endswith("<|im_start|>assistant\n")
    assert tok.decode(tok.encode("round trip")) == "round trip"


def test_template_from_jinja_file(tokenizer_dir, tmp_path):
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}|jinja")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "q"}]) == "q|jinja"


def test_no_template_is_a_clear_error(tokenizer_dir, tmp_path):
    for f in tokenizer_dir.iterdir():
        if f.name != "chat_template.jinja":
            shutil.copy(f, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "q"}])


def _tiny_gguf(path, add_bos: bool = True):
    """A GGUF holding only a byte-level BPE tokenizer that adds a BOS, and one tensor."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    tokens = ["<s>", "</s>", "a", "b", "Ġ", "ab", "Ġa", "h", "i", "hi"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    writer.add_token_merges(["a b", "Ġ a", "h i"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _behaviour(tok: Tokenizer, texts) -> tuple:
    return (
        [tok.encode(t) for t in texts],
        [tok.decode(tok.encode(t), skip_special_tokens=True) for t in texts],
        tok.apply_chat_template([{"role": "user", "content": texts[0]}]),
        tok.eos_token_ids,
        tok.bos_token_id,
        tok.vocab_size,
        tok.name,
    )


def test_a_gguf_tokenizer_is_converted_once_then_read_from_the_cache_alike(model_path, tmp_path, monkeypatch, caplog):
    from servelm.models import tokenizer as tokenizer_mod

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    conversions = []
    convert = tokenizer_mod._convert_gguf_tokenizer
    monkeypatch.setattr(tokenizer_mod, "_convert_gguf_tokenizer", lambda p: conversions.append(p) or convert(p))
    tiny = tmp_path / "tiny.gguf"
    _tiny_gguf(tiny)
    for path, texts in [(model_path, TEXTS), (tiny, ["ab ab hi", "a b"])]:
        conversions.clear()
        first = load_tokenizer(path, eos_token_ids=[1], max_model_len=64)
        again = load_tokenizer(path, eos_token_ids=[1], max_model_len=64)
        assert conversions == [path]  # the second start read the cache
        assert _behaviour(again, texts) == _behaviour(first, texts)
    assert load_tokenizer(tiny).encode("ab") == [0, 5]  # its BOS, then "ab" merged, from the cache too
    entries = sorted((tmp_path / "cache" / "servelm" / "tokenizers").iterdir())
    assert len(entries) == 2 and not any(e.name.startswith(".tmp-") for e in entries)

    # A file written anew (another size or time) is converted again, under a key of its own.
    written = tiny.stat().st_mtime_ns
    _tiny_gguf(tiny, add_bos=False)
    os.utime(tiny, ns=(written, written + 10**9))  # a second later, on a file system of any time resolution
    assert load_tokenizer(tiny).encode("ab") == [5]
    assert conversions == [tiny, tiny]
    # A damaged entry is converted again with a warning, and replaced.
    for entry in (tmp_path / "cache" / "servelm" / "tokenizers").iterdir():
        (entry / "tokenizer.json").write_text("{")
    with caplog.at_level("WARNING", logger="servelm.models.tokenizer"):
        assert load_tokenizer(tiny).encode("ab") == [5]
    assert "does not load" in caplog.text and conversions == [tiny, tiny, tiny]
    assert load_tokenizer(tiny).encode("ab") == [5] and len(conversions) == 3


def test_a_new_cache_entry_deletes_the_entries_unused_for_a_month(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "servelm" / "tokenizers"
    tiny = tmp_path / "tiny.gguf"
    _tiny_gguf(tiny)
    load_tokenizer(tiny)
    (used,) = folder.iterdir()
    stale, recent, left_staging = folder / "0123456789abcdef", folder / "fedcba9876543210", folder / ".tmp-dead"
    for entry in (stale, recent, left_staging):
        entry.mkdir()
        (entry / "tokenizer.json").write_text("{}")
    month_ago = time.time() - STALE_SECONDS - 60
    for entry in (used, stale, left_staging):
        os.utime(entry, (month_ago, month_ago))
    assert load_tokenizer(tiny).encode("ab") == [0, 5]  # read from the cache: marks the entry used
    assert used.stat().st_mtime > month_ago + 60
    other = tmp_path / "other.gguf"
    _tiny_gguf(other, add_bos=False)
    assert load_tokenizer(other).encode("ab") == [5]  # a new entry: the stale ones go
    left = set(folder.iterdir())
    assert {used, recent} < left and len(left) == 3  # the used, the recent and the new entry
    assert not stale.exists() and not left_staging.exists()


def test_a_cache_that_cannot_be_written_still_loads_the_tokenizer(tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")  # the cache's parent is a file: every write to it fails
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    tiny = tmp_path / "tiny.gguf"
    _tiny_gguf(tiny)
    assert load_tokenizer(tiny).encode("ab") == [0, 5]
    assert load_tokenizer(tiny).encode("ab") == [0, 5]
