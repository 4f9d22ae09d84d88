"""Weight-only int8 quantization of a loaded model (``--quantization int8``).

Every linear layer of the decoder and the LM head get int8 weights with one
scale per output row (symmetric, round to nearest). Decoding a few sequences
is bound by reading the weights, so small batches run an int8 weight-only
kernel with bf16 activations, which reads a quarter of the float32 bytes:
servelm's own for one row (``servelm.kernels``, where it is built), torch's
``aten._weight_int8pack_mm`` otherwise (where the input width is a multiple
of 16: that kernel crashes on other widths, which take the dense copy).
Large batches are bound by compute, where that kernel is slow, so they run a
GEMM in the model's dtype on the same weights dequantized once (prepacked
for oneDNN in bfloat16, as ``packed.py`` does for unquantized models). Both
paths compute with the quantized weights: the model is the same at every
batch size, up to the activations' rounding.

The dense copy costs memory (in bfloat16 only its prepacked form is kept):
this mode trades memory for latency at low concurrency; it is CPU-only (the
kernel's CPU path is what it is for).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from servelm import kernels
from servelm.models.packed import PackedLinear, can_pack, replace_linears

# Rows (tokens) up to which the int8 kernel runs; past it, the float copy is
# faster. Set from timings on a 2-core AVX-512 CPU when the int8 mode was
# added; no script in bench/ re-measures the crossover (bench/quantized.py
# times batch 1, bench/w8a8_gemm.py the int8 kernel at M = 1 only).
SMALL_BATCH = 4


class Int8Rows(nn.Module):
    """A linear layer's weight ``[out, in]`` as int8 rows times bfloat16 per-row scales (symmetric, round to
    nearest, in [-127, 127]; each scale max |row| / 127, rounded to bfloat16 before the rows are divided by
    it), and its bias: what :class:`Int8Linear` and ``w8a8.W8A8Linear`` share."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny).to(torch.bfloat16)
        self.register_buffer("qweight", torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def one_row_weights(self) -> kernels.LinearWeights:
        """What servelm's one-call decoding step reads of this layer for one row (the int8 matrix-vector
        kernel, as forward runs it)."""
        return kernels.LinearWeights(self.qweight, self.scales, self.bias, "int8")


class Int8Linear(Int8Rows):
    """``y = x W^T + b`` with ``W`` stored as int8 rows times per-row scales."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, small_batch: int = SMALL_BATCH):
        super().__init__(weight, bias)
        self.small_batch = small_batch
        # The dequantized weights, in the model's dtype, for large batches: only
        # a oneDNN-prepacked copy where oneDNN runs (packed.py; a bfloat16 one
        # packed as float32 on CPUs without bfloat16 instructions).
        dense = (self.qweight.float() * self.scales.float()[:, None]).to(weight.dtype)
        packable = can_pack(weight.dtype, weight.device)
        self.dense = PackedLinear(dense, self.bias) if packable else None
        self.register_buffer("weight", None if packable else dense)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, x.shape[-1]).to(torch.bfloat16).contiguous() if rows <= self.small_batch else None
        native = kernels.for_tensors(flat) if rows == 1 else None
        if native:
            out = native.int8_linear(flat, self.qweight, self.scales).to(x.dtype)
        elif flat is not None and self.in_features % 16 == 0:  # PyTorch's kernel crashes on other widths
            out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales).to(x.dtype)
        else:
            return F.linear(x, self.weight, self.bias) if self.dense is None else self.dense(x)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_int8(model: nn.Module, head_weight: torch.Tensor | None) -> int:
    """Replace every ``nn.Linear`` of ``model`` by an :class:`Int8Linear`, in place.

    ``head_weight`` is the LM head's weight when the model has no linear
    head module of its own (tied embeddings); it becomes ``model.lm_head``.
    Returns the number of layers quantized.
    """
    return replace_linears(model, Int8Linear, head_weight)
