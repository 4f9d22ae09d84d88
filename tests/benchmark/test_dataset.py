"""Prompts: synthetic ones from a tokenizer's ids, random words, or a prompt file; output lengths."""

from __future__ import annotations

import json
import random

import pytest

from servelm.benchmark.dataset import (
    CORPUS,
    file_requests,
    load_prompt_file,
    output_lengths,
    parse_range,
    synthetic_requests,
    token_pool,
)


class ByteTokenizer:
    """One token per UTF-8 byte (the fake connector's tokenizer), counting decode calls."""

    description = "bytes"

    def __init__(self) -> None:
        self.decodes = 0

    async def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode()]

    async def decode(self, ids: list[int]) -> str:
        self.decodes += 1
        return bytes(i - 3 for i in ids).decode()


def test_output_lengths_fixed_and_range():
    assert output_lengths(3, random.Random(0), fixed=7) == [7, 7, 7]
    lengths = output_lengths(500, random.Random(0), fixed=7, span=(4, 9))
    assert min(lengths) == 4 and max(lengths) == 9  # inclusive, and the range wins over fixed
    assert lengths == output_lengths(500, random.Random(0), span=(4, 9))  # seeded
    with pytest.raises(ValueError):
        output_lengths(3, random.Random(0))


def test_parse_range():
    assert parse_range("16:64") == (16, 64)
    assert parse_range("5:5") == (5, 5)
    for bad in ("16", "0:4", "9:4", "a:b", "4:"):
        with pytest.raises(ValueError):
            parse_range(bad)


async def test_token_pool_is_the_corpus_distinct_ids():
    pool = await token_pool(ByteTokenizer())
    assert pool == sorted({b + 3 for b in CORPUS.encode()})


async def test_synthetic_completion_prompts_are_exact_token_ids():
    tok = ByteTokenizer()
    pool = await token_pool(tok)
    reqs = await synthetic_requests([4, 5, 6], 32, random.Random(1), tokenizer=tok, as_token_ids=True)
    assert [r.output_len for r in reqs] == [4, 5, 6]
    for r in reqs:
        assert isinstance(r.prompt, list) and len(r.prompt) == 32 and r.prompt_len == 32
        assert set(r.prompt) <= set(pool)
    assert len({tuple(r.prompt) for r in reqs}) == 3  # distinct prompts: no shared prefix cache
    assert tok.decodes == 0
    again = await synthetic_requests([4, 5, 6], 32, random.Random(1), tokenizer=tok, as_token_ids=True)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


async def test_synthetic_chat_prompts_are_decoded_text():
    tok = ByteTokenizer()
    reqs = await synthetic_requests([8] * 5, 20, random.Random(2), tokenizer=tok, as_token_ids=False)
    assert tok.decodes == 5
    for r in reqs:
        assert isinstance(r.prompt, str) and len(await tok.encode(r.prompt)) == 20


async def test_words_when_there_is_no_tokenizer():
    reqs = await synthetic_requests([3, 3], 50, random.Random(0), tokenizer=None, as_token_ids=True)
    words = set(CORPUS.split())
    for r in reqs:
        assert isinstance(r.prompt, str) and len(r.prompt.split()) == 50 and set(r.prompt.split()) <= words
        assert r.prompt_len == 50


def test_prompt_file_lines_and_jsonl(tmp_path):
    plain = tmp_path / "prompts.txt"
    plain.write_text("What is 2+2?\n\n  Name a planet.\n{not json at all\n")
    assert load_prompt_file(plain) == ["What is 2+2?", "  Name a planet.", "{not json at all"]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in ({"prompt": "one"}, {"prompt": "two\nlines", "id": 2})) + "\n")
    assert load_prompt_file(jsonl) == ["one", "two\nlines"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no prompt key"}) + "\n")
    with pytest.raises(ValueError, match="prompt"):
        load_prompt_file(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompt_file(empty)


def test_file_requests_wrap_around_from_an_offset():
    reqs = file_requests(["a", "b", "c"], [1, 2, 3, 4], offset=2)
    assert [r.prompt for r in reqs] == ["c", "a", "b", "c"]
    assert [r.output_len for r in reqs] == [1, 2, 3, 4]
    assert all(r.prompt_len is None for r in reqs)
