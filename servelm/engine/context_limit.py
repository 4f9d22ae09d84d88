"""Whether a prompt and its completion fit a model's context, and the error's wording.

Torch-free, so the API (which checks early, with the count it already has)
and the engine (which checks every request, offline ones too) share one rule
and one message.
"""

from __future__ import annotations


def context_length_error(max_model_len: int, prompt_tokens: int, max_tokens: int | None, where: str) -> str | None:
    """The message for a prompt plus completion that does not fit, or None if it fits.

    ``where`` names what holds the prompt ("messages", "prompt", "input").
    ``max_tokens`` None means "up to the context", which needs room for at
    least one generated token; 0 means nothing is generated (embeddings).
    """
    if max_tokens is None:
        if prompt_tokens < max_model_len:
            return None
        return (
            f"This model's maximum context length is {max_model_len} tokens. However, your {where} "
            f"resulted in {prompt_tokens} tokens, which leaves no room for the completion. "
            f"Please reduce the length of the {where}."
        )
    if max_tokens == 0:  # nothing generated: embeddings
        if prompt_tokens <= max_model_len:
            return None
        return (
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens} tokens in the {where}. Please reduce the length of the {where}."
        )
    if prompt_tokens + max_tokens <= max_model_len:
        return None
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {where}, {max_tokens} in the "
        f"completion). Please reduce the length of the {where} or completion."
    )
