"""Each token's own bytes, for logprobs.

Decoding one token on its own gives U+FFFD for a token that holds only part
of a UTF-8 character (an emoji or a CJK character split over two or three
tokens), and a SentencePiece decoder drops a lone token's leading space. So
the bytes come from the vocabulary piece instead, read the way the
tokenizer's decoder reads it:

- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): each character of the piece
  stands for one byte (GPT-2's byte-to-unicode table);
- SentencePiece (Llama 2, Mistral): ``▁`` is a space and ``<0xNN>`` one byte;
- anything else: the UTF-8 of the token decoded on its own.

Added tokens (``<|im_end|>`` and the like) are their own text.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


class TokenBytes:
    """``token_bytes(id)``: the bytes a token stands for, cached per id. ``hf`` is a HF fast tokenizer."""

    def __init__(self, hf: Any):
        self._hf = hf
        self._added = {int(i): t.content for i, t in hf.added_tokens_decoder.items()}
        decoder = json.dumps(json.loads(hf.backend_tokenizer.to_str()).get("decoder"))
        self._byte_level = _byte_level_table() if '"ByteLevel"' in decoder else None
        self._sentencepiece = any(f'"{kind}"' in decoder for kind in ("Metaspace", "ByteFallback")) or "▁" in decoder
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        raw = self._cache.get(token_id)
        if raw is None:
            raw = self._cache[token_id] = self._read(token_id)
        return raw

    def _read(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode()
        piece = self._hf.convert_ids_to_tokens(token_id)
        if piece is not None and self._byte_level is not None and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        if piece is not None and self._sentencepiece:
            byte = _BYTE_PIECE.fullmatch(piece)
            return bytes([int(byte.group(1), 16)]) if byte else piece.replace("▁", " ").encode()
        return self._hf.decode([token_id], skip_special_tokens=False).encode()
