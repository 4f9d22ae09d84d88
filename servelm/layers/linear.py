"""Linear layers that fuse several projections of one input into one matmul (q/k/v, gate/up).

The model is built with these (plain ``nn.Linear`` underneath), and a
checkpoint's separate tensors are copied into their shards. After loading,
``servelm.models.weight_layout`` swaps every linear layer for the layout that
runs fastest on the device: oneDNN-prepacked with servelm's own kernels for
decoding (``servelm.models.packed.PackedLinear``), int8
(``servelm.models.quantization.Int8Linear``) or int8 weights and activations
(``servelm.models.w8a8.W8A8Linear``); each of those picks its native kernel or
PyTorch in its ``forward``.
"""

from __future__ import annotations

import torch
from torch import nn


class FusedLinear(nn.Linear):
    """``nn.Linear`` whose output rows are several projections stacked, ``shard_sizes`` rows each."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias, dtype=dtype)
        self.shard_sizes = list(shard_sizes)

    def shard(self, param: torch.Tensor, index: int) -> torch.Tensor:
        """The rows of ``param`` (this layer's weight or bias) that projection ``index`` fills."""
        return param.split(self.shard_sizes, dim=0)[index]
