"""Whether an op's tensors can go to servelm's native CPU kernels as they are."""

from __future__ import annotations

import torch

from servelm import kernels


def kernels_taking(*tensors: torch.Tensor) -> kernels.CpuKernels | None:
    """servelm's CPU kernels if these tensors are contiguous and the kernels take them, else None (PyTorch path)."""
    return kernels.for_tensors(*tensors) if all(t.is_contiguous() for t in tensors) else None
