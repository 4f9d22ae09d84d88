"""Compiling structured-output specs into xgrammar grammars for one model's tokenizer.

One :class:`GrammarCompiler` per engine. Its xgrammar ``TokenizerInfo`` (the
vocabulary decoded to bytes, which tokens are special and which stop) is
built on first use, once, since most engines never see a constrained
request. Compiled grammars are cached by (kind, spec) in a
:class:`GrammarCache`; compiling is thread-safe and is meant to run in a
worker thread, never on the engine loop.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import xgrammar as xgr

from servelm.engine.grammar_cache import GrammarCache, GrammarCacheStats
from servelm.engine.grammar_matcher import GrammarMatcher
from servelm.engine.structured_outputs import StructuredOutputsError, StructuredOutputsParams

# xgrammar's C++ errors start with a timestamp, a source location and sometimes a
# failed check's text: none of it helps a client.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
# JSON output without free whitespace between tokens (", " and ": " separators): a small model
# sampled at a high temperature can otherwise fill its whole budget with newlines.
_JSON_OPTIONS: dict[str, Any] = {"any_whitespace": False}


class GrammarCompiler:
    """Compiles :class:`StructuredOutputsParams` for one tokenizer, each spec once.

    ``tokenizer`` is servelm's :class:`~servelm.models.tokenizer.Tokenizer`;
    ``vocab_size`` is the model's (its logits' width), which may differ from
    the tokenizer's; ``stop_token_ids`` are the tokens that end a grammar.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int], max_entries: int = 256):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._xgr_compiler: xgr.GrammarCompiler | None = None
        self._init_lock = threading.Lock()
        self._cache: GrammarCache[xgr.CompiledGrammar] = GrammarCache(self._compile_key, max_entries)

    @property
    def stats(self) -> GrammarCacheStats:
        """Cache hits, compiles and the seconds spent compiling."""
        return self._cache.stats

    def cached(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar | None:
        """The compiled grammar if it is already in the cache; never compiles (safe on any thread)."""
        return self._cache.peek((params.kind, params.spec))

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar for ``params``, from the cache or compiled now (blocking).

        Raises :class:`StructuredOutputsError` (``param`` ``structured_outputs.<kind>``)
        when the spec does not compile.
        """
        return self._cache.get((params.kind, params.spec))

    def _compiler(self) -> xgr.GrammarCompiler:
        with self._init_lock:
            if self._xgr_compiler is None:
                info = tokenizer_info(self._tokenizer.hf, self.vocab_size, self._stop_token_ids)
                # servelm's cache keeps the compiled grammars; xgrammar's own would hold a second copy.
                self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._xgr_compiler

    def _compile_key(self, key: Any) -> xgr.CompiledGrammar:
        kind, spec = key
        compiler = self._compiler()
        try:
            compiled = _compile(compiler, kind, spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            param = f"structured_outputs.{kind}"
            raise StructuredOutputsError(param, f"{param} {_WHAT[kind]}: {clean_error(exc)}") from None
        if GrammarMatcher(compiled, self._stop_token_ids).allows_nothing():
            # Say "root ::= root", a schema that only refers to itself or the regex [^\s\S]: no text fits.
            param = f"structured_outputs.{kind}"
            raise StructuredOutputsError(param, f"{param} allows no output at all: no text can complete it")
        return compiled


def _compile(compiler: xgr.GrammarCompiler, kind: str, spec: str) -> xgr.CompiledGrammar:
    if kind == "json":
        return compiler.compile_json_schema(spec, strict_mode=True, **_JSON_OPTIONS)
    if kind == "json_object":
        # Any object: strict mode off, else an object schema without properties allows only {}.
        return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **_JSON_OPTIONS)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(json.loads(spec)))
    if kind == "grammar":
        return compiler.compile_grammar(spec)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(spec)
    raise ValueError(f"unknown structured output kind {kind!r}")


_WHAT = {
    "json": "is not a JSON schema servelm can enforce",
    "json_object": "could not be compiled",
    "regex": "is not a valid regular expression",
    "choice": "could not be compiled",
    "grammar": "is not a valid EBNF grammar",
    "structural_tag": "is not a valid structural tag",
}


def clean_error(exc: BaseException) -> str:
    """xgrammar's error message without its C++ prefix, on one line."""
    lines = [_CPP_PREFIX.sub("", line).strip() for line in str(exc).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices``."""
    # JSON string literals are EBNF string literals: the same quotes and escapes.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def tokenizer_info(hf: Any, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of a Hugging Face tokenizer, with its special tokens never allowed in output.

    The model's ``vocab_size`` sets the bitmask's width: ids past the
    tokenizer's vocabulary (padding) are never allowed. Special tokens
    (``<|im_start|>``, ...) are in the vocabulary as text, so xgrammar would
    let a JSON string contain one; an empty entry is what xgrammar treats as
    special. Stop tokens stay: they end the grammar.
    """
    detected = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    metadata = json.loads(detected.dump_metadata())
    vocab = [""] * vocab_size
    for token, token_id in hf.get_vocab().items():
        if token_id < vocab_size:
            vocab[token_id] = token
    stops = set(stop_token_ids)
    for token_id, added in getattr(hf, "added_tokens_decoder", {}).items():
        if added.special and token_id < vocab_size and token_id not in stops:
            vocab[token_id] = ""
    return xgr.TokenizerInfo(
        vocab,
        xgr.VocabType(metadata["vocab_type"]),
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids,
        add_prefix_space=metadata["add_prefix_space"],
    )
