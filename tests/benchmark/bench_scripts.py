"""The scripts of bench/, imported in tests.

They import each other as siblings (``import model_cost``), as Python allows a
script run from its folder; so bench/ goes on ``sys.path``, at the end, where
it shadows no installed package.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_script(name: str) -> ModuleType:
    """The module of ``bench/<name>.py``."""
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    return importlib.import_module(name)
