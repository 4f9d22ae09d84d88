"""The tool-call formats servelm reads, by name, and which one a chat template implies."""

from __future__ import annotations

from servelm.engine.tool_parsers.format import ToolCallFormat
from servelm.engine.tool_parsers.hermes import HERMES
from servelm.engine.tool_parsers.llama3_json import LLAMA3_JSON
from servelm.engine.tool_parsers.mistral import MISTRAL

FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}
AUTO = "auto"  # the --tool-call-parser value that means "from the chat template"


def get_format(name: str) -> ToolCallFormat:
    """The format called ``name``; ValueError naming the known ones otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r}; known: {', '.join(FORMATS)}") from None


def detect_format(chat_template: str | None) -> str:
    """The format a chat template's model family writes calls in; Hermes when the template does not tell.

    Mistral's and Llama 3's templates name their special tokens
    (``[TOOL_CALLS]``; ``<|python_tag|>`` or Llama 3's header tokens);
    ChatML (Qwen, SmolLM, Hermes) and anything else get Hermes, the format
    servelm also teaches templates that know nothing of tools.
    """
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return MISTRAL.name
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return LLAMA3_JSON.name
    return HERMES.name


def resolve_format(setting: str, chat_template: str | None) -> str:
    """The format to use: the setting (--tool-call-parser) unless it is ``auto``, else the template's."""
    return detect_format(chat_template) if setting == AUTO else get_format(setting).name
