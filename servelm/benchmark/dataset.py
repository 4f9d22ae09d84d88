"""The benchmark's prompts: synthetic ones of a given token length, or read from a file.

Synthetic prompts are random token ids drawn from a pool: the ids a
tokenizer gives a fixed English text (so no special tokens, and every id is
a real word piece). For ``completions`` the ids are sent as they are, which
makes the prompt length exact; for ``chat`` they are decoded to text, which
the server tokenizes again (within a few tokens of the length, plus the chat
template's own tokens). The tokenizer is the server's (``POST /tokenize`` and
``/detokenize``, servelm's and vLLM's), or a local one, or, with neither, the
prompt is that many random words (about one token each).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp

if TYPE_CHECKING:
    from servelm.benchmark.client import BenchClient

# Plain English whose tokens make the pool of synthetic prompts.
CORPUS = (
    "The history of the river valley begins long before the first farmers arrived. Glaciers carved the "
    "wide basin, and for thousands of years the water carried sand, clay and stones down from the "
    "mountains to the sea. People came to hunt deer and to fish for salmon in the cold pools below the "
    "falls. Later they cleared the forest, planted wheat and barley, built houses of timber and stone, "
    "and raised sheep on the hills above the village. Markets grew into towns, and the towns were joined "
    "by roads, bridges and finally a railway that brought coal, iron and new ideas from distant cities. "
    "Scientists who study the valley today measure the temperature of the water, count the birds that "
    "nest along the banks, and record how quickly the seasons change. Their reports describe a landscape "
    "that is always moving: floods reshape the channel, old meadows return to woodland, and children "
    "still learn to swim in the same quiet bend where their grandparents once played. Music, stories and "
    "recipes travel along the river as easily as boats, and every summer a festival fills the square "
    "with dancing, bright lanterns, fresh bread, honey, apples and the sound of many languages. "
    "Engineers, teachers, doctors and artists explain their work to visitors, while libraries keep maps, "
    "letters and photographs that show how ordinary families lived, worked, argued, celebrated and "
    "planned for a better future through war, drought, invention and peace."
)


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: the prompt (text, or token ids for completions) and its lengths.

    ``prompt_len`` is the prompt's length in tokens where known (synthetic
    prompts), else None; the server's usage chunk gives the real count.
    """

    prompt: str | list[int]
    prompt_len: int | None
    output_len: int


class PromptTokenizer(Protocol):
    """What synthetic prompts need from a tokenizer."""

    description: str

    async def encode(self, text: str) -> list[int]: ...

    async def decode(self, ids: list[int]) -> str: ...


class ServerTokenizer:
    """The served model's own tokenizer, over ``POST /tokenize`` and ``POST /detokenize``."""

    def __init__(self, client: BenchClient, model: str):
        self.client = client
        self.model = model
        self.description = f"the server's ({model}, via /tokenize)"

    @classmethod
    async def probe(cls, client: BenchClient, model: str) -> ServerTokenizer | None:
        """The server's tokenizer, or None when the server has no working /tokenize."""
        tokenizer = cls(client, model)
        try:
            ids = await tokenizer.encode("Hello world")
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            return None
        return tokenizer if ids else None

    async def encode(self, text: str) -> list[int]:
        reply = await self.client.json(
            "POST", "/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False}
        )
        return [int(i) for i in reply["tokens"]]

    async def decode(self, ids: list[int]) -> str:
        reply = await self.client.json("POST", "/detokenize", {"model": self.model, "tokens": ids})
        return str(reply["prompt"])


class LocalTokenizer:
    """A tokenizer loaded here (HF folder, GGUF file or bundled model name); imports transformers."""

    def __init__(self, name_or_path: str):
        from servelm.models.registry import resolve_model_path
        from servelm.models.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(resolve_model_path(name_or_path))
        self.description = f"local ({name_or_path})"

    async def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def output_lengths(
    n: int, rng: random.Random, fixed: int | None = None, span: tuple[int, int] | None = None
) -> list[int]:
    """``n`` output lengths: all ``fixed``, or uniform over the inclusive range ``span``."""
    if span is not None:
        low, high = span
        return [rng.randint(low, high) for _ in range(n)]
    if fixed is None:
        raise ValueError("give a fixed output length or a range")
    return [fixed] * n


def parse_range(text: str) -> tuple[int, int]:
    """``"16:64"`` -> ``(16, 64)``; raises ValueError unless 1 <= LO <= HI."""
    low, sep, high = text.partition(":")
    try:
        span = (int(low), int(high)) if sep else None
    except ValueError:
        span = None
    if span is None or not 1 <= span[0] <= span[1]:
        raise ValueError(f"bad range {text!r}: expected LO:HI with 1 <= LO <= HI")
    return span


def load_prompt_file(path: str | Path) -> list[str]:
    """Prompts from a file: one per line, or JSON lines with a ``"prompt"`` string; blank lines skipped."""
    prompts = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                record: Any = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if isinstance(record, dict):
                if not isinstance(record.get("prompt"), str):
                    raise ValueError(f'{path}:{number}: a JSON line needs a "prompt" string')
                prompts.append(record["prompt"])
                continue
        prompts.append(line)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


async def token_pool(tokenizer: PromptTokenizer) -> list[int]:
    """The distinct token ids of the corpus, sorted (so a seed picks the same prompts every run)."""
    pool = sorted(set(await tokenizer.encode(CORPUS)))
    if not pool:
        raise ValueError("the tokenizer gave no tokens for the corpus")
    return pool


async def synthetic_requests(
    lengths: Sequence[int],
    input_len: int,
    rng: random.Random,
    *,
    tokenizer: PromptTokenizer | None,
    as_token_ids: bool,
    pool: Sequence[int] | None = None,
    max_parallel: int = 16,
) -> list[BenchRequest]:
    """One request of ``input_len`` random tokens per output length in ``lengths``.

    ``as_token_ids`` keeps the prompt as token ids (completions); otherwise it
    is decoded to text. With no tokenizer, the prompt is ``input_len`` random
    words of the corpus.
    """
    if tokenizer is None:
        words = CORPUS.split()
        return [BenchRequest(" ".join(rng.choices(words, k=input_len)), input_len, n) for n in lengths]
    if pool is None:
        pool = await token_pool(tokenizer)
    id_lists = [rng.choices(pool, k=input_len) for _ in lengths]
    if as_token_ids:
        return [BenchRequest(ids, input_len, n) for ids, n in zip(id_lists, lengths)]
    limit = asyncio.Semaphore(max_parallel)

    async def decode(ids: list[int]) -> str:
        async with limit:
            return await tokenizer.decode(ids)

    texts = await asyncio.gather(*(decode(ids) for ids in id_lists))
    return [BenchRequest(text, input_len, n) for text, n in zip(texts, lengths)]


def file_requests(prompts: Sequence[str], lengths: Sequence[int], offset: int = 0) -> list[BenchRequest]:
    """One request per output length, taking ``prompts`` in order from ``offset``, wrapping around."""
    return [BenchRequest(prompts[(offset + i) % len(prompts)], None, n) for i, n in enumerate(lengths)]
