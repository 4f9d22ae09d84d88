"""Each token's own bytes (for logprobs), on a byte-level BPE tokenizer and a SentencePiece one."""

from __future__ import annotations

import pytest

from servelm.engine.outputs import TokenLogprob
from servelm.models.token_bytes import TokenBytes
from servelm.models.tokenizer import load_tokenizer

TEXTS = ["Hello, world!", "café, naïve, 日本語 and 中文", "emoji 😀🎉👨‍👩‍👧 flag 🇫🇷", "  tabs\tand\nnewlines  "]


@pytest.fixture(scope="module")
def smollm2(model_path):
    return load_tokenizer(model_path)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_tokens_bytes_add_up_to_the_text(smollm2, text):
    ids = smollm2.encode(text, add_special_tokens=False)
    assert b"".join(smollm2.token_bytes(i) for i in ids) == text.encode()


def test_a_token_with_part_of_a_character_has_those_bytes_and_an_escaped_text(smollm2):
    ids = smollm2.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # the emoji's four bytes take several tokens
    parts = [smollm2.token_bytes(i) for i in ids]
    assert b"".join(parts) == "🎉".encode()
    texts = [TokenLogprob(i, 0.0, raw).text for i, raw in zip(ids, parts)]
    assert "\ufffd" not in "".join(texts)
    assert texts[0] == parts[0].decode("utf-8", errors="backslashreplace") and "\\x" in texts[0]
    assert len(set(texts)) == len(set(ids))  # distinct tokens keep distinct texts


def test_special_tokens_are_their_own_text(smollm2):
    assert smollm2.token_bytes(2) == b"<|im_end|>"


def test_sentencepiece_pieces_read_spaces_and_byte_tokens():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁Hello": 1, "<0xF0>": 2, "<0x9F>": 3, "▁": 4, "world": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # Llama 2's decoder: ▁ to space, byte pieces to bytes, the first space stripped.
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    token_bytes = TokenBytes(PreTrainedTokenizerFast(tokenizer_object=backend))
    assert [token_bytes(i) for i in (1, 2, 3, 4, 5)] == [b" Hello", b"\xf0", b"\x9f", b" ", b"world"]
