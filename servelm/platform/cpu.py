"""What this CPU's matrix library can do, asked once for the engine's dtype choice and the models' layouts."""

from __future__ import annotations

import torch


def onednn_has_bf16() -> bool:
    """Whether oneDNN multiplies bfloat16 with bfloat16 instructions on this CPU (AVX512-BF16, AMX).

    False where oneDNN is missing or would emulate them (AVX2 and older), about 10x slower than float32.
    """
    available: bool = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    return available and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_emulates_bf16() -> bool:
    """Whether oneDNN runs here but has no bfloat16 instructions on this CPU (AVX2 and older)."""
    available: bool = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    return available and not onednn_has_bf16()
