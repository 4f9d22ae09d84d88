"""int8 compute for a loaded model (``--quantization w8a8``): int8 weights times int8 activations.

Every linear layer, the LM head included, gets int8 weights with one scale
per output row, as ``--quantization int8`` makes them
(``quantization.Int8Rows``). Where ``int8`` multiplies several rows in
bfloat16 over a dequantized copy, ``w8a8`` quantizes each row of the
activations on the fly (symmetric, one scale per token: max |x| / 127) and
multiplies int8 by int8 with int32 sums, scaled back once per output. On CPUs
with AVX512-VNNI that runs servelm's W8A8 GEMM (``servelm.kernels``, over the
weights packed once at load), about twice the multiply rate of bfloat16's
``vdpbf16ps``, and on CPUs with AMX-INT8 the same GEMM on the tile unit, twice
the rate of oneDNN's AMX-BF16: it is for prefill and batched decoding, which
are bound by compute. Elsewhere (no compiler, no VNNI) ``torch._int_mm`` runs
the same arithmetic, more slowly, after one warning.

One row (one sequence decoding) is bound by reading the weights, not by
multiplying: it keeps the weight-only int8 matrix-vector kernel over the plain
int8 rows (bfloat16 activations, no activation rounding), which is also what
servelm's one-call decoding step reads (``one_row_weights``). The plain rows
and the packed ones are both int8: the two copies together weigh what one
bfloat16 copy does. CPU only.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from servelm import kernels
from servelm.layers.activation import silu_and_mul
from servelm.models.packed import replace_linears
from servelm.models.quantization import Int8Rows

logger = logging.getLogger(__name__)


ANY_ROWS = 1 << 30  # rows_weights' max_rows: the packed weight takes any number of rows


@functools.cache
def _warn_portable(reason: str) -> None:
    logger.warning("w8a8: servelm's int8 GEMM does not run here (%s): torch._int_mm runs instead, slower", reason)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` ``[M, K]`` as int8 (round to nearest, in [-127, 127]) and float32 scales ``[M, 1]``
    (max |row| / 127), as the kernel quantizes them."""
    xf = x.float()
    top = xf.abs().amax(dim=1, keepdim=True)
    # 127 / max as the kernel computes it, bit for bit (PyTorch's 127.0 / top is 127 * (1 / top), an ulp off)
    inverse = torch.where(top > 0, torch.full_like(top, 127.0) / top, torch.zeros_like(top))
    return torch.round(xf * inverse).clamp(-127, 127).to(torch.int8), top / 127.0


class W8A8Linear(Int8Rows):
    """``y = x W^T + b`` with ``W`` int8 rows times per-row scales and ``x`` quantized per row to int8; the plain
    int8 rows serve one-row products and the portable path, the packed ones the kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight, bias)
        self.register_buffer("weight_scales", self.scales.float())
        native = kernels.cpu_kernels() if weight.device.type == "cpu" else None
        self.packed = native.w8a8_pack(self.qweight) if native is not None else None
        if self.packed is None:
            _warn_portable("no AVX512-VNNI" if native is not None else "servelm's CPU kernels are unavailable")

        # pair_gate_up: the packed rows (and their scales and bias) in gate/up pairs of 16-row blocks
        self.gate_up_pairs = False
        # an LM head's: forward returns float32 logits (the values rounded to x's dtype), written as such
        self.float_out = False
        self.packed_bias: torch.Tensor | None = None if self.bias is None else self.bias.data

    def pair_gate_up(self) -> bool:
        """Lay the packed weight out for :meth:`silu_mul`, this layer being a gated MLP's gate and up
        projections (gate rows, then up): 16 gate rows, then their 16 up rows, and so on, so that the GEMM
        can finish each pair of blocks as ``silu(gate) * up``. False (nothing changed) where the kernel does
        not run or the inner size is not a multiple of 16. The plain int8 rows stay as they are; a second call
        changes nothing."""
        inner = self.out_features // 2
        if self.packed is None or self.out_features % 32:
            return False
        order = torch.arange(self.out_features, device=self.qweight.device).view(2, inner // 16, 16)
        order = order.transpose(0, 1).reshape(-1)
        self.packed = kernels.cpu_kernels().w8a8_pack(self.qweight[order])
        self.weight_scales = self.scales.float()[order]
        self.packed_bias = None if self.bias is None else self.bias[order].contiguous()
        self.gate_up_pairs = True
        return True

    def rows_weights(self) -> kernels.LinearWeights | None:
        """What servelm's one-call decoding step reads of this layer for 2 rows or more (the packed weight, as
        ``forward`` and, after :meth:`pair_gate_up`, ``silu_mul`` run them); None where the kernel does not
        run."""
        if self.packed is None:
            return None
        return kernels.LinearWeights(
            self.packed, self.weight_scales, self.packed_bias, "w8a8", max_rows=ANY_ROWS, silu_mul=self.gate_up_pairs
        )

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu_and_mul(self(x))``, to the last bit in bfloat16 on AVX512-BF16 CPUs: after
        :meth:`pair_gate_up`, in the GEMM itself for several rows, without the gate and up outputs in memory."""
        flat = x.reshape(-1, self.in_features).contiguous()
        native = kernels.for_tensors(flat)
        if not self.gate_up_pairs or native is None or flat.shape[0] < 2:
            return silu_and_mul(self(x))
        bias = None if self.packed_bias is None else self.packed_bias.to(flat.dtype)
        out = native.w8a8_linear(flat, self.packed, self.weight_scales, self.out_features, bias, silu_mul=True)
        return out.reshape(*x.shape[:-1], self.out_features // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        bias = None if self.bias is None else self.bias.to(flat.dtype)
        native = kernels.for_tensors(flat)
        if flat.shape[0] == 1 and flat.dtype == torch.bfloat16 and native is not None:
            out = native.int8_linear(flat, self.qweight, self.scales)
            out = out if bias is None else out + bias
        elif self.packed is not None and native is not None:
            packed_bias = None if self.packed_bias is None else self.packed_bias.to(flat.dtype)
            out = native.w8a8_linear(
                flat, self.packed, self.weight_scales, self.out_features, packed_bias, float_out=self.float_out
            )
            if self.gate_up_pairs:  # back from the pairs of blocks to gate, then up
                out = out.view(-1, self.out_features // 32, 2, 16).transpose(1, 2).reshape(-1, self.out_features)
        else:
            q, row_scales = quantize_activations(flat)
            sums = torch._int_mm(q, self.qweight.t())
            out = sums.float() * row_scales * self.weight_scales
            out = (out if bias is None else out + bias.float()).to(flat.dtype)
        out = out.float() if self.float_out else out
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_w8a8(model: nn.Module, head_weight: torch.Tensor | None) -> int:
    """Replace every ``nn.Linear`` of ``model`` (the LM head included, or ``head_weight`` where the head is
    tied to the embedding) by a :class:`W8A8Linear`, in place. Returns the number of layers quantized.

    The head multiplies in int8 too: it is the largest single GEMM of a step at many sequences, and on the
    bundled model it moved perplexity from +3.5% to +4.1% over bfloat16's (bench/quant_quality.py with
    four license texts, docs/BENCHMARKS.md): most of w8a8's cost in quality is the decoder's rounding.
    """
    count = replace_linears(model, W8A8Linear, head_weight)
    head = getattr(model, "lm_head", None)
    if isinstance(head, W8A8Linear):  # float32 logits straight from the GEMM, not a copy of its output
        head.float_out = True
    for module in model.modules():  # the gated MLPs' SiLU * up, done by their gate_up GEMMs
        gate_up = getattr(module, "gate_up_proj", None)
        if isinstance(gate_up, W8A8Linear):
            gate_up.pair_gate_up()
    return count
