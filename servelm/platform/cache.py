"""servelm's folder in the user's cache directory: ``$XDG_CACHE_HOME/servelm``, default ``~/.cache/servelm``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(part: str) -> Path:
    """``<cache>/servelm/<part>`` (not created here): ``kernels`` for the built CPU kernels, ``tokenizers`` for
    the tokenizers converted from GGUF files."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "servelm" / part
