"""The tokenizer of a model: a HF fast tokenizer plus what the engine needs from it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from servelm.engine.detokenizer import TextDecoder
from servelm.engine.tool_parsers import AUTO, get_format, resolve_format
from servelm.models.token_bytes import TokenBytes
from servelm.models.tool_prompt import template_reads_tools, tool_messages
from servelm.platform.cache import cache_dir, prune

logger = logging.getLogger(__name__)

# Tokenizer lengths above this are transformers' "no limit" placeholder, not a real context size.
_UNSET_MAX_LENGTH = 10**12


class Tokenizer:
    """Wraps a ``PreTrainedTokenizerFast``; ``hf`` is the wrapped one, ``text_decoder`` what the engine's
    incremental detokenizers decode with (:func:`text_decoder`).

    ``eos_token_ids`` gathers every id that ends generation: the model config's,
    generation_config.json's and the tokenizer's own eos.
    """

    def __init__(
        self,
        hf: Any,
        eos_token_ids: Iterable[int] = (),
        max_model_len: int | None = None,
        name: str = "model",
    ) -> None:
        self.hf = hf
        self.name = name
        eos = set(int(i) for i in eos_token_ids)
        if hf.eos_token_id is not None:
            eos.add(int(hf.eos_token_id))
        self.eos_token_ids: set[int] = eos
        self.bos_token_id: int | None = hf.bos_token_id
        self.pad_token_id: int | None = hf.pad_token_id
        self.vocab_size: int = len(hf)
        template = hf.chat_template
        if isinstance(template, dict):  # several named templates: the default one serves chat
            template = template.get("default")
        self.chat_template: str | None = template or None
        if max_model_len is None and hf.model_max_length < _UNSET_MAX_LENGTH:
            max_model_len = int(hf.model_max_length)
        self.max_model_len: int | None = max_model_len
        self._template_reads_tools: dict[str, bool] = {}  # by template text (the model's, an override)
        self._token_bytes: TokenBytes | None = None
        self.text_decoder = text_decoder(hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their ids."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (part of a character, for some): see :mod:`~servelm.models.token_bytes`."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.hf)
        return self._token_bytes(token_id)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Vocabulary strings (byte-level pieces, not text) of ``ids``."""
        return self.hf.convert_ids_to_tokens(ids)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_call_parser: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` to a prompt string, as transformers' ``apply_chat_template(tokenize=False)``.

        ``chat_template`` overrides the model's; extra kwargs (``documents``,
        template variables) go to the template. ``tools`` (OpenAI tool
        definitions), assistant ``tool_calls`` and ``tool`` messages are
        rendered by the template when it knows tools, else taught to it in
        the ``tool_call_parser`` format (default: the one the template
        implies); see :mod:`servelm.models.tool_prompt`.
        """
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(
                f"{self.name} has no chat template; pass one (chat_template=...) or use the completions API"
            )
        has_tools = bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
        if has_tools:
            fmt = get_format(resolve_format(tool_call_parser or AUTO, template))
            messages, tool_kwargs = tool_messages(messages, tools, fmt, self._reads_tools(template))
            kwargs.update(tool_kwargs)
        return self.hf.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=template,
            **kwargs,
        )

    def _reads_tools(self, template: str) -> bool:
        known = self._template_reads_tools.get(template)
        if known is None:
            known = self._template_reads_tools[template] = template_reads_tools(template)
        return known


def load_tokenizer(
    path: str | os.PathLike[str],
    eos_token_ids: Iterable[int] = (),
    max_model_len: int | None = None,
) -> Tokenizer:
    """Load from a HF folder (tokenizer.json, ...) or a .gguf file, never from the network."""
    from transformers import AutoTokenizer

    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return Tokenizer(_gguf_tokenizer(path), eos_token_ids, max_model_len, name=path.name)
    hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if not hf.chat_template:
        hf.chat_template = _read_chat_template(path)
    eos = set(eos_token_ids) | _generation_eos(path)
    return Tokenizer(hf, eos, max_model_len, name=path.name)


def _gguf_tokenizer(path: Path) -> Any:
    """The tokenizer of a GGUF file, converted by transformers once and kept in servelm's cache.

    transformers reads the file's whole vocabulary and merges in Python to build it (0.6-1.3 s for
    the bundled 49k vocabulary on a 2-core VM, every start); saved, it loads in about a third of that
    (0.2-0.8 s). The cached copy is keyed by
    the file's path, size and modification time and the converting libraries' versions; one that
    cannot be read or written is converted again, with no harm but the time.
    """
    import tokenizers
    import transformers
    from transformers import PreTrainedTokenizerFast

    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|{tokenizers.__version__}"
    cached = cache_dir("tokenizers") / hashlib.sha256(key.encode()).hexdigest()[:16]
    if cached.is_dir():
        try:
            hf = PreTrainedTokenizerFast.from_pretrained(str(cached), local_files_only=True)
            with contextlib.suppress(OSError):
                os.utime(cached)  # used now: `prune` keeps it (reading a folder's files leaves its times)
            return hf
        except Exception as exc:  # a damaged entry: convert again below and replace it
            logger.warning(
                "the cached tokenizer of %s in %s does not load (%s): converting it again", path, cached, exc
            )
            shutil.rmtree(cached, ignore_errors=True)
    hf = _convert_gguf_tokenizer(path)
    try:
        _keep(hf, cached)
    except Exception as exc:  # a cache that cannot be written costs the next start the conversion, no more
        logger.info("could not keep the tokenizer of %s in %s (%s)", path, cached.parent, exc)
    return hf


def _keep(hf: Any, cached: Path) -> None:
    """Save ``hf`` as the cache entry ``cached``, whole or not at all: a concurrent start sees either."""
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cached.parent))
    try:
        hf.save_pretrained(str(staging))
        staging.rename(cached)  # atomic; fails if another start put its entry there first
    except OSError:
        if not cached.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    prune(cached, "*")  # entries of files, times or library versions unused for a month


def _convert_gguf_tokenizer(path: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    # The fast class straight away: AutoTokenizer would first parse the whole file
    # to pick a class (seconds), while the backend it builds is the same either way.
    return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


class _CleanUpOff:
    """A Hugging Face tokenizer's ``decode`` without clean-up of tokenization spaces: clean-up rewrites text
    around later tokens, so it cannot be applied a piece at a time."""

    def __init__(self, hf: Any) -> None:
        self._hf = hf

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._hf.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def text_decoder(hf: Any) -> TextDecoder:
    """``decode(ids, skip_special_tokens)`` of ``hf`` (a Hugging Face tokenizer) without clean-up: the
    ``tokenizers`` backend itself where ``hf`` decodes through it unchanged (a third of the time a call,
    twice a generated token), else ``hf.decode`` with clean-up off."""
    from transformers import PreTrainedTokenizerFast as Fast

    cls = type(hf)
    if isinstance(hf, Fast) and cls.decode is Fast.decode and cls._decode is Fast._decode:
        return hf.backend_tokenizer
    return _CleanUpOff(hf)


def _read_chat_template(folder: Path) -> str | None:
    """A template transformers did not pick up: chat_template.jinja or chat_template.json."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    as_json = folder / "chat_template.json"
    if as_json.is_file():
        return json.loads(as_json.read_text()).get("chat_template")
    return None


def _generation_eos(folder: Path) -> set[int]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return set()
    value = json.loads(path.read_text()).get("eos_token_id")
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)
