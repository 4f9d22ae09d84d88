"""A tiny byte-level BPE tokenizer, built in memory, for grammar tests that need no model.

Ids 0-2 are special (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, the
last one EOS), then the 256 byte-level characters, then a few merges, so
one text has several tokenizations, as with a real vocabulary.
"""

from __future__ import annotations

from types import SimpleNamespace

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS = 2
MERGES = [('"', "a"), ("a", "b"), ("{", '"'), ('"', ":")]


def tiny_hf_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for char in bytes_to_unicode().values():
        vocab[char] = len(vocab)
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", bos_token="<|im_start|>")


def tiny_tokenizer() -> SimpleNamespace:
    """What GrammarCompiler reads of servelm's Tokenizer: ``hf``."""
    return SimpleNamespace(hf=tiny_hf_tokenizer())
