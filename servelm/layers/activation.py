"""SwiGLU's activation: ``silu(gate) * up``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from servelm.layers.native import kernels_taking


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[..., 2 * inner]``, gate first: ``[..., inner]``."""
    native = kernels_taking(gate_up)
    if native:
        return native.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
