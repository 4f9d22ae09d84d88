"""Whether token ids given by a client are ids of a model's vocabulary, and the error's wording.

Torch-free, so the engine (prompts), the embedding engine (inputs) and the
local connector (detokenize) share one rule and one message.
"""

from __future__ import annotations

from collections.abc import Iterable


def vocabulary_error(token_ids: Iterable[object], vocab_size: int) -> str | None:
    """The message naming the first entry that is not a token id in ``[0, vocab_size)``, or None if all are."""
    for token_id in token_ids:
        if not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
            return f"token id {token_id!r} is outside the vocabulary [0, {vocab_size})"
    return None
