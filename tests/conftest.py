"""Shared fixtures. Tests never reach for a model hub."""

from __future__ import annotations

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Ray (tests/ray_serve, and `servelm serve --replicas` started by tests): no token auth
# in tests, and every address on 127.0.0.1. Set before anything imports Ray,
# which reads them once.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

MODEL = "smollm2-135m-instruct"
# The shared engines and the transformers reference run where ``--device auto``
# puts the engine: the CPU here and in CI, the GPU on a machine with one, so the
# same tests check the CUDA path there. CPU-only layouts (packing, int8
# kernels) pin ``device="cpu"`` in their own tests.
DEVICE = "auto"


@pytest.fixture(scope="session")
def model_path():
    """The bundled SmolLM2 GGUF file."""
    from servelm.models.registry import resolve_model_path

    return resolve_model_path(MODEL)


@pytest.fixture(scope="session")
def hf_model(model_path):
    """transformers' own implementation of the bundled model: the reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
    model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name, dtype=torch.float32)
    model.eval()
    return model, tok


@pytest.fixture(scope="session")
def hf_reference(hf_model, llm):
    """The transformers reference on the shared engine's device (a copy, where that is not the CPU)."""
    model, tok = hf_model
    device = llm.engine.runner.device
    return (model if device.type == "cpu" else copy.deepcopy(model).to(device)), tok


@pytest.fixture(scope="session")
def llm():
    """One engine on the bundled model, shared by tests that don't need special limits."""
    from servelm import LLM

    return LLM(MODEL, dtype="float32", device=DEVICE, kv_cache_memory=256 << 20)
