"""servelm: an OpenAI-compatible LLM inference server with its own serving engine.

``from servelm import LLM, SamplingParams, StructuredOutputsParams`` gives the offline API. Imports are
lazy so that the HTTP layer can import ``servelm`` without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from servelm.platform.arena import one_arena

one_arena()  # before any thread of ours allocates: see servelm/platform/arena.py

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__"]

if TYPE_CHECKING:
    from servelm.engine.sampling_params import SamplingParams
    from servelm.engine.structured_outputs import StructuredOutputsParams
    from servelm.llm import LLM


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from servelm.llm import LLM

        return LLM
    if name == "SamplingParams":
        from servelm.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from servelm.engine.structured_outputs import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module 'servelm' has no attribute {name!r}")
