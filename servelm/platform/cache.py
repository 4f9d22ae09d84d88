"""servelm's folder in the user's cache directory: ``$XDG_CACHE_HOME/servelm``, default ``~/.cache/servelm``."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

# An entry of the cache (a kernels build, a converted tokenizer) not used for this long is deleted
# when a new entry is made beside it.
STALE_SECONDS = 30 * 24 * 3600


def cache_dir(part: str) -> Path:
    """``<cache>/servelm/<part>`` (not created here): ``kernels`` for the built CPU kernels, ``tokenizers`` for
    the tokenizers converted from GGUF files."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "servelm" / part


def prune(keep: Path, pattern: str) -> None:
    """Delete the entries beside ``keep`` (its folder's ``pattern``, files or folders) neither opened nor
    written for ``STALE_SECONDS``. A user of a deleted entry makes it again; a process that has a file
    mapped keeps its mapping. Entries that are gone already or not ours to delete are left."""
    cutoff = time.time() - STALE_SECONDS
    for old in keep.parent.glob(pattern):
        try:
            stat = old.stat()
            if old == keep or max(stat.st_atime, stat.st_mtime) >= cutoff:
                continue
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink()
        except OSError:
            pass
