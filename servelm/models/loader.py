"""Load a model, its config and its tokenizer from a bundled name, a HF folder or a GGUF file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from servelm.models.config import ModelConfig
from servelm.models.llama import LlamaForCausalLM, build_empty_model
from servelm.models.registry import resolve_model_path
from servelm.models.tokenizer import Tokenizer, load_tokenizer

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ModelLoadError(ValueError):
    """A path that exists but holds no model we can load."""


def load_model(
    name_or_path: str, dtype: torch.dtype, device: torch.device | str
) -> tuple[LlamaForCausalLM, ModelConfig, Tokenizer]:
    """Model (eval mode, on ``device`` in ``dtype``), its config and its tokenizer.

    ``name_or_path`` is a bundled model name, a .gguf file, a folder holding one
    .gguf file, or a HF folder (config.json + *.safetensors + tokenizer files).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(str, _DTYPES))}; got {dtype}")
    device = torch.device(device)
    path = resolve_model_path(name_or_path)
    gguf_file = _find_gguf(path)
    if gguf_file is not None:
        from servelm.models.gguf_loader import load_gguf_model

        model, config = load_gguf_model(gguf_file, dtype, device)
        tokenizer_path = gguf_file
    else:
        model, config = load_hf_model(path, dtype, device)
        tokenizer_path = path
    tokenizer = load_tokenizer(tokenizer_path, config.eos_token_ids, config.max_model_len)
    return model, config, tokenizer


def load_hf_model(folder: Path, dtype: torch.dtype, device: torch.device) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Model and config from a HF folder with safetensors weights."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder} has no config.json (and no .gguf file)")
    config = ModelConfig.from_hf_dict(json.loads(config_path.read_text()))
    files = _safetensors_files(folder)
    model = build_empty_model(config, dtype, device)
    model.load_weights(_read_safetensors(files))
    return model, config


def _find_gguf(path: Path) -> Path | None:
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; give a .gguf file or a HF model folder")
        return path
    if (path / "config.json").is_file():
        return None
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ModelLoadError(f"{path} holds several .gguf files ({names}); name one")
    return ggufs[0] if ggufs else None


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        found = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
        raise ModelLoadError(
            f"{folder} has no *.safetensors weights (found: {found}); .bin checkpoints are not supported"
        )
    return files


def _read_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) one at a time; load_weights' copy_ casts and moves each."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f:
                yield name, f.get_tensor(name)
