"""RMSNorm, with the residual add fused in."""

from __future__ import annotations

import torch
from torch import nn

from servelm.layers.native import kernels_taking


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like HF's LlamaRMSNorm.

    Called with a ``residual`` it first adds ``x`` to it and normalises the sum,
    returning ``(normed, new residual)``; the native kernel updates the residual
    in place.
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            native = kernels_taking(x, self.weight)
            return native.rms_norm(x, self.weight, self.eps) if native else self._norm(x)
        native = kernels_taking(x, residual, self.weight)
        if native:
            return native.rms_norm(x, self.weight, self.eps, residual), residual
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
