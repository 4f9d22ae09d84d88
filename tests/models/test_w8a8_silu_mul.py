"""W8A8's gated MLP in one GEMM: the gate/up layer's packed rows in pairs of 16-row blocks, and the kernel
writing ``silu(gate) * up`` of each pair itself, against the product followed by ``silu_and_mul``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from servelm.layers.activation import silu_and_mul
from servelm.models.w8a8 import W8A8Linear, quantize_w8a8

# (M, K, inner): 2 rows (the fewest that fuse; one row keeps the weight-only kernel), VNNI's 6-row tiles and
# 48-row items ragged (7, 49), AMX's first 8 rows and its 32-row steps ragged (8, 33), past one 256-row work
# item (300); a single pair of blocks (16), pairs past one 64-output VNNI panel and one 256-output AMX item
# (48, 160, 1536); inputs not a multiple of 64 (37, 100).
SHAPES = [(2, 64, 16), (7, 100, 48), (8, 37, 32), (33, 576, 1536), (49, 64, 160), (300, 100, 160)]


def paths(native_kernels) -> list[bool]:
    """The W8A8 kernel's paths on this CPU: AMX (where it runs) and VNNI."""
    return [True, False] if native_kernels.w8a8_use_amx() else [False]


def avx512_bf16(native_kernels) -> bool:
    """Whether the kernels' bfloat16 SiLU is their AVX512-BF16 one (the pair layout is made only there)."""
    return native_kernels.pack_pairs(torch.zeros(32, 32, dtype=torch.bfloat16)) is not None


@pytest.mark.parametrize(("m", "k", "inner"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_gate_up_gives_silu_mul_of_the_product(native_kernels, m, k, inner, dtype):
    gen = torch.Generator().manual_seed(m * 100 + inner)
    layer = W8A8Linear(
        torch.randn(2 * inner, k, generator=gen).to(dtype), torch.randn(2 * inner, generator=gen).to(dtype)
    )
    if layer.packed is None:
        pytest.skip("this CPU has no AVX512-VNNI: the W8A8 kernel does not run")
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    amx = native_kernels.w8a8_use_amx()
    try:
        for on in paths(native_kernels):
            native_kernels.w8a8_use_amx(on)
            product = layer(x)
            expected = silu_and_mul(product)
            assert layer.pair_gate_up()  # a second time (the second path) changes nothing
            got = layer.silu_mul(x)
            assert got.shape == (m, inner) and got.dtype == dtype
            if dtype == torch.bfloat16 and avx512_bf16(native_kernels):  # both calls' SiLU, to the last bit
                assert torch.equal(got, expected), f"amx={on}"
            else:  # the separate SiLU's exp is libm's vectorized one, the fused one's libm's scalar one
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            # the paired layout changes nothing that forward returns
            assert torch.equal(layer(x), product), f"amx={on}"
    finally:
        native_kernels.w8a8_use_amx(amx)


def test_one_row_and_a_layer_that_cannot_pair_keep_the_separate_silu(native_kernels):
    gen = torch.Generator().manual_seed(0)
    odd = W8A8Linear(torch.randn(2 * 24, 64, generator=gen).bfloat16())  # 24 outputs a half: not whole blocks
    if odd.packed is None:
        pytest.skip("this CPU has no AVX512-VNNI: the W8A8 kernel does not run")
    assert not odd.pair_gate_up() and not odd.gate_up_pairs
    x = torch.randn(5, 64, generator=gen).bfloat16()
    assert torch.equal(odd.silu_mul(x), silu_and_mul(odd(x)))
    paired = W8A8Linear(torch.randn(64, 64, generator=gen).bfloat16())
    row = x[:1]
    before = silu_and_mul(paired(row))
    assert paired.pair_gate_up()
    assert torch.equal(paired.silu_mul(row), before)  # one row: the weight-only int8 kernel over the plain rows


def test_the_kernel_refuses_silu_mul_over_outputs_not_in_pairs_of_blocks(native_kernels):
    packed = native_kernels.w8a8_pack(torch.randint(-127, 128, (48, 64), dtype=torch.int8))
    if packed is None:
        pytest.skip("this CPU has no AVX512-VNNI: the W8A8 kernel does not run")
    with pytest.raises(ValueError, match="pairs of 16"):
        native_kernels.w8a8_linear(torch.randn(3, 64), packed, torch.rand(48), 48, silu_mul=True)


def test_quantize_w8a8_pairs_the_gate_up_of_every_mlp(native_kernels):
    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Linear(64, 64, bias=False)
            self.down_proj = nn.Linear(32, 64, bias=False)

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([MLP(), MLP()])
            self.lm_head = nn.Linear(64, 16, bias=False)

    model = Tiny()
    assert quantize_w8a8(model, None) == 5
    if model.layers[0].gate_up_proj.packed is None:
        pytest.skip("this CPU has no AVX512-VNNI: the W8A8 kernel does not run")
    assert all(layer.gate_up_proj.gate_up_pairs for layer in model.layers)
    assert not any(layer.down_proj.gate_up_pairs for layer in model.layers) and not model.lm_head.gate_up_pairs
