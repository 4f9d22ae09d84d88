"""Linear layers with oneDNN-prepacked bfloat16 or float32 weights, for CPU inference.

oneDNN multiplies faster when a weight is stored once in its own blocked
layout than when it reorders a plain weight on every call, most of all for
the few rows of a decoding step (``bench/gemm.py --no-head``). In float32 the
plain ``F.linear`` (MKL) lost most to it: on a Zen 1 with AVX2 the packed
weights multiplied 8 rows 2.7x and 32 rows 1.8x faster, 512 rows 1.1x
(docs/BENCHMARKS.md). The packed weight is opaque: only this module's forward
uses it.

A bfloat16 layer on a CPU without bfloat16 instructions (``packed_dtype``)
keeps its packed weight in float32: oneDNN would emulate bfloat16 there,
about 10x slower than its float32 GEMM (6 against 65 GFLOP/s on that Zen 1).
Widened once at load, the weights give the same products, summed in float32
and rounded once to bfloat16, as a bfloat16 GEMM's; only the decoding copy
below stays in bfloat16, where one row reads half float32's bytes.

One row (batch-1 decoding) is the exception: oneDNN's packed GEMV reads the
weights well below memory speed there, servelm's own matrix-vector kernel
(``servelm.kernels``) close to it (``bench/gemm.py``); on AVX2 CPUs it beats
oneDNN for a few rows more too, reading the weight once for all of them
(``plain_rows``). It needs the plain weight, so a layer can keep that too
(``keep_plain``), at the cost of a second copy of the weights;
``weight_layout.py`` asks for it when the copy fits in memory. On
AVX512-BF16 CPUs the copy can instead be in the layout of servelm's
small-GEMM kernel (``pair_rows``), which serves one row as fast as
the matrix-vector kernel and 2 to ``PAIR_MAX_ROWS`` rows (decoding a few
dozen sequences) faster than oneDNN where oneDNN has no more than the same
instructions (``bench/gemm.py``; where oneDNN has more, AMX, it is used for
one row, and for the rows a speculative engine verifies); ``pair_rows`` says
up to how many rows, as the ``cpu_matmul`` setting pins it or a timing at
start-up finds.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

from servelm import kernels
from servelm.platform.cpu import onednn_has_bf16

logger = logging.getLogger(__name__)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this torch build packs a layer of ``dtype`` (float32 or bfloat16) for oneDNN on ``device``,
    in ``packed_dtype(dtype)``."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()


def packed_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype oneDNN multiplies a layer of ``dtype`` in: float32 for a bfloat16 layer where oneDNN has no
    bfloat16 instructions (module docstring), else ``dtype`` itself."""
    return torch.float32 if dtype == torch.bfloat16 and not onednn_has_bf16() else dtype


PAIR_MAX_ROWS = 64  # the most rows the small-GEMM kernel takes; oneDNN's packed GEMM catches up beyond


def plain_rows(dtype: torch.dtype) -> int:
    """The most rows that servelm's matrix-vector kernel multiplies over a kept plain weight (read once for all
    of them) rather than oneDNN. On AVX2 CPUs it beats oneDNN's packed GEMM up to 16 rows in bfloat16
    (widened to float32 for it: 1.15x at 16 rows, 0.9x at 32, 2.8x at 2) and up to 64 in float32 (1.1x at
    64) on the decoder's shapes with the weights streaming from memory (Zen 1, ``bench/gemm.py``); on AVX-512
    CPUs oneDNN has twice its lanes, and it takes one row. A speculative step's verified rows go to it
    wherever the plain weight is kept (``rows_alike``)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        return 1
    return PAIR_MAX_ROWS if dtype == torch.float32 else 16


def pair_rows(cpu_matmul: str) -> int:
    """The most rows of a product that go to servelm's small-GEMM kernel (over weights in its pair layout)
    rather than to oneDNN; 0: none, and no pair layout is kept. ``pairs`` and ``onednn`` pin it without a
    timing (``PAIR_MAX_ROWS`` and 0; ``pairs`` falls back to 0, with a warning, where the kernel does not
    run); ``auto`` asks ``timed_pair_rows``. Wherever the layout is kept, a speculative step's verified rows
    go to it whatever this says (``rows_alike``).
    """
    if cpu_matmul == "onednn":
        logger.info("cpu_matmul onednn: decoding's small matmuls use oneDNN, as pinned")
        return 0
    if cpu_matmul == "auto":
        return timed_pair_rows()  # 0 where the kernel does not run, said once
    if _small_gemm_kernels() is None:
        logger.warning(
            "cpu_matmul pairs: servelm's small-GEMM kernel does not run here (%s): using oneDNN", _NO_SMALL_GEMM
        )
        return 0
    logger.info("cpu_matmul pairs: decoding's small matmuls use the pair layout, as pinned")
    return PAIR_MAX_ROWS


_ROWS_ALIKE: contextvars.ContextVar[bool] = contextvars.ContextVar("servelm_rows_alike", default=False)


@contextlib.contextmanager
def rows_alike() -> Iterator[None]:
    """Within it, every product of up to ``PAIR_MAX_ROWS`` rows over a kept pair layout runs on the vector
    unit, and over a kept plain weight on the matrix-vector kernel, which compute each row exactly as they
    compute one row alone, however many come: a speculative step's verified rows then get the logits of plain
    decoding's one row, and greedy output stays plain decoding's. Outside it, 2 to ``PAIR_MAX_ROWS`` rows may
    go to the tile unit (AMX) or oneDNN, faster and summed in another order."""
    token = _ROWS_ALIKE.set(True)
    try:
        yield
    finally:
        _ROWS_ALIKE.reset(token)


def in_rows_alike() -> bool:
    """Whether this runs within ``rows_alike``."""
    return _ROWS_ALIKE.get()


_NO_SMALL_GEMM = "it needs servelm's CPU kernels, an AVX512-BF16 CPU and oneDNN's bfloat16 packing"


def _small_gemm_kernels() -> kernels.CpuKernels | None:
    """The kernels where the small GEMM runs beside oneDNN's packed bfloat16 GEMM, else None."""
    native = kernels.cpu_kernels()
    probe = torch.zeros(32, 2, dtype=torch.bfloat16)
    runs = native is not None and native.pack_pairs(probe) is not None and onednn_has_bf16()
    return native if runs else None


def _best_times(runs: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Each run's best of five calls, alternating (after one round that pays oneDNN's set-up)."""
    best = dict.fromkeys(runs, float("inf"))
    with torch.inference_mode():
        for _ in range(6):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - start)
    return best


@functools.cache
def timed_pair_rows() -> int:
    """``PAIR_MAX_ROWS`` where servelm's small-GEMM kernel multiplies 32 rows faster than oneDNN's packed GEMM
    on this CPU, else 1; 0 where it does not run.

    It wins at 32 rows on AVX512-BF16 CPUs where oneDNN has the same instructions (``bench/gemm.py``); where
    oneDNN has more (AMX) it loses there. One row it serves as fast as the matrix-vector kernel, whose
    plain copy of the weights it then replaces, so that one row is computed alike in every engine,
    speculative or not (``pair_rows``). One [32, 576] x [576, 3072] product each way, the best of five
    alternating calls (a few milliseconds), settles it, logged with its figures.
    """
    native = _small_gemm_kernels()
    if native is None:
        logger.info("cpu_matmul auto: decoding's small matmuls use oneDNN (%s)", _NO_SMALL_GEMM)
        return 0
    weight = torch.randn(3072, 576).to(torch.bfloat16)
    pairs = native.pack_pairs(weight)
    packed = PackedLinear(weight)
    x = torch.randn(32, 576).to(torch.bfloat16)
    best = _best_times({"pairs": lambda: native.gemm_pairs(x, pairs, 3072), "onednn": lambda: packed(x)})
    rows = PAIR_MAX_ROWS if best["pairs"] < best["onednn"] else 1
    more = "oneDNN"
    if rows < PAIR_MAX_ROWS and native.pairs_amx(576):
        more = f"the same layout on AMX tiles up to {PAIR_MAX_ROWS} rows, then oneDNN"
    logger.info(
        "cpu_matmul auto: a [32, 576] x [576, 3072] bfloat16 matmul takes %.3f ms in the pair layout vs %.3f ms "
        "in oneDNN's: up to %d %s the pair layout, more %s",
        best["pairs"] * 1e3,
        best["onednn"] * 1e3,
        rows,
        "row uses" if rows == 1 else "rows use",
        more,
    )
    return rows


class PackedLinear(nn.Module):
    """``y = x W^T + b`` through oneDNN with ``W`` prepacked; with ``pair_rows`` > 0, up to that many rows
    (at most ``PAIR_MAX_ROWS``) go to servelm's small-GEMM kernel over a copy of ``W`` in its pair layout
    where that kernel runs (``pair_weight`` is None elsewhere), and on AMX CPUs the rows past them up to
    ``PAIR_MAX_ROWS`` to the same layout on the tile unit (``amx_pairs``), which multiplies decoding's few
    dozen rows faster than oneDNN there (``bench/gemm.py``); failing that, with ``keep_plain``, up to
    ``plain_rows`` rows go to its matrix-vector kernel over the plain ``W`` where that is built. oneDNN
    multiplies in ``packed_dtype`` (the output in ``W``'s dtype whatever it is)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_plain: bool = False, pair_rows: int = 0
    ):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_as = packed_dtype(weight.dtype)
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(self.packed_as).contiguous())
        self.bias = None if bias is None else bias.detach().clone()
        self.packed_bias = None if bias is None else self.bias.to(self.packed_as)
        self.pair_rows = min(pair_rows, PAIR_MAX_ROWS)
        native = kernels.for_tensors(weight) if self.pair_rows > 0 else None
        self.pair_weight = native.pack_pairs(weight.detach()) if native else None
        self.amx_pairs = native is not None and self.pair_weight is not None and native.pairs_amx(self.in_features)
        # The pair layout serves one row as fast as the plain weight does: no need for both.
        self.plain_weight = weight.detach().contiguous() if keep_plain and self.pair_weight is None else None
        self.plain_rows = plain_rows(weight.dtype) if self.plain_weight is not None else 0

    def one_row_weights(self) -> kernels.LinearWeights | None:
        """What servelm's one-call decoding step reads of this layer for one row: the pair layout or the plain
        weight, where kept."""
        if self.pair_weight is not None:
            return kernels.LinearWeights(self.pair_weight, None, self.bias, "pairs", vector_rows=self.pair_rows)
        if self.plain_weight is None or self.plain_weight.dtype != torch.bfloat16:
            return None
        return kernels.LinearWeights(self.plain_weight, None, self.bias)

    def rows_weights(self) -> kernels.LinearWeights | None:
        """What servelm's one-call decoding step reads of this layer for 2 rows or more, as ``forward`` runs
        them: the pair layout, up to ``pair_rows`` rows on the vector unit and on to ``PAIR_MAX_ROWS`` on AMX
        tiles where ``amx_pairs``, or the plain bfloat16 weight up to ``plain_rows``; None where ``forward``
        would not run 2 rows on either."""
        if self.pair_weight is None:
            if self.plain_rows < 2 or self.plain_weight is None or self.plain_weight.dtype != torch.bfloat16:
                return None
            return kernels.LinearWeights(self.plain_weight, None, self.bias, max_rows=self.plain_rows)
        most = PAIR_MAX_ROWS if self.amx_pairs else self.pair_rows
        if most < 2:
            return None
        return kernels.LinearWeights(
            self.pair_weight, None, self.bias, "pairs", vector_rows=self.pair_rows, max_rows=most
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        rows = flat.shape[0]
        alike = rows <= PAIR_MAX_ROWS and _ROWS_ALIKE.get()
        pairs = self.pair_weight is not None and (
            rows <= self.pair_rows or alike or (rows <= PAIR_MAX_ROWS and self.amx_pairs)
        )
        if pairs and (native := kernels.for_tensors(flat)):
            amx = rows > self.pair_rows and not alike
            out = native.gemm_pairs(flat, self.pair_weight, self.out_features, self.bias, amx=amx)
        elif (
            (rows <= self.plain_rows or alike)
            and self.plain_weight is not None
            and (native := kernels.for_tensors(flat, self.plain_weight))
        ):
            out = native.gemv(flat, self.plain_weight, self.bias)
        else:
            out = self.forward_packed(flat)
        return out.reshape(*x.shape[:-1], self.out_features)

    def forward_packed(self, flat: torch.Tensor) -> torch.Tensor:
        """oneDNN's product of ``flat`` ``[M, in_features]`` over the packed weight, whatever the rows."""
        out = torch.ops.mkldnn._linear_pointwise(
            flat.to(self.packed_as), self.packed_weight, self.packed_bias, "none", [], ""
        )
        return out.to(flat.dtype)


def replace_linears(model: nn.Module, make, head_weight: torch.Tensor | None) -> int:
    """Replace every ``nn.Linear`` of ``model`` by ``make(weight, bias)``, in place.

    ``head_weight`` is the LM head's weight when the model has no linear
    head module of its own (tied embeddings); ``make(head_weight, None)``
    becomes ``model.lm_head``. Returns the number of layers replaced.
    """
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, make(linear.weight, linear.bias))
    if head_weight is not None:
        model.lm_head = make(head_weight, None)
        return len(targets) + 1
    return len(targets)
