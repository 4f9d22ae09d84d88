"""Native CPU kernels, compiled from C on first use.

- ``paged_attention.c``: decode attention over the paged KV cache. PyTorch has
  no CPU kernel for it: the portable path gathers every sequence's keys and
  values into a dense copy and calls SDPA, whose CPU kernel spends most of its
  time on per-head overhead when each sequence has one query token. This one
  reads the cache blocks in place (2-4x faster per layer, bench/kernels.py).
  Beside it, prefill attention (bfloat16 on AVX512-BF16 CPUs): every
  prefilling sequence of a step in one call, causal over its cached prefix and
  its new tokens, where PyTorch gathers and calls SDPA per sequence (~3-4x
  faster per layer for prompts of a few hundred tokens).
- ``fused_ops.c``: the decoder's elementwise chains (residual add + RMSNorm,
  RoPE on q and k, SiLU * up), one call each instead of up to 20 small
  PyTorch ops, whose per-op overhead dominates a small batch; and the copy of
  a step's K/V rows into their cache slots.
- ``gemv.c``: matrix-vector products for batch-1 decoding, bfloat16 and
  int8 weights, streaming each weight row once at close to memory speed:
  about twice oneDNN's prepacked GEMV and PyTorch's ``_weight_int8pack_mm``
  for one row (bench/gemm.py, bench/quantized.py).
- ``decode_one.c``: a whole decoding step of a Llama-family model for one
  sequence in one call, running the kernels above layer after layer: with one
  token in flight the Python around ~400 small calls a step cost as much as
  the calls themselves.

The sources are compiled once per machine with the system's C compiler
(``$CC``, default ``cc``) into one library in the user's cache directory
(``$XDG_CACHE_HOME/servelm/kernels``, default ``~/.cache/servelm/kernels``)
and loaded with ctypes as a ``PyDLL``, which keeps the GIL through each call
as PyTorch's own small ops do: a ``CDLL`` would hand it over at every call,
and the engine thread would then wait on the server's event loop a hundred
times a step. The build uses
``-march=native``, so the file name carries a hash of the sources, the flags,
the compiler's version and this CPU's feature flags; a new build deletes the
others that have not been opened for a month. A freshly loaded library
is checked against PyTorch on small cases before it is used. Without a
compiler, or if the build or the check fails, ``cpu_kernels()`` returns None
(with one warning) and callers keep the PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

_SOURCES = sorted(Path(__file__).parent.glob("*.c"))
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))
_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
# Linked without -ffast-math: on older GCC that would link crtfastmath.o, whose
# constructor switches the whole process to flush-to-zero.
_LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "servelm" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str) -> Path:
    """Compile the source unless this machine's build is cached; returns the library's path."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256()
    for part in (
        *(source.read_bytes() for source in _SOURCES + _HEADERS),
        " ".join(_COMPILE_FLAGS + _LINK_FLAGS).encode(),
        version.encode(),
        _cpu_flags().encode(),
    ):
        key.update(part)
    target = _cache_dir() / f"servelm_kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [Path(tmp) / f"{source.stem}.o" for source in _SOURCES]
        lib = Path(tmp) / "servelm_kernels.so"
        commands = [[compiler, *_COMPILE_FLAGS, "-c", str(src), "-o", str(obj)] for src, obj in zip(_SOURCES, objects)]
        commands.append([compiler, *map(str, objects), "-o", str(lib), *_LINK_FLAGS])
        for cmd in commands:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        os.replace(lib, target)  # atomic: a concurrent process sees no half-written file
    logger.info("compiled servelm's CPU kernels into %s", target)
    _prune(target)
    return target


# Builds of other sources (older servelm versions) unused for this long are deleted after a new build.
_STALE_SECONDS = 30 * 24 * 3600


def _prune(keep: Path) -> None:
    """Delete the cache's other builds not opened for ``_STALE_SECONDS`` (a checkout still using one
    rebuilds it in seconds; a process that has one loaded keeps its mapping)."""
    cutoff = time.time() - _STALE_SECONDS
    for old in keep.parent.glob("servelm_kernels-*.so"):
        try:
            stat = old.stat()
            if old != keep and max(stat.st_atime, stat.st_mtime) < cutoff:
                old.unlink()
        except OSError:
            pass  # gone already, or not ours to delete


_P, _I, _F, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {  # C function (without its dtype suffix) -> argument types; all return void
    "paged_decode": [_P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _T],
    "add_rms_norm": [_P, _P, _P, _P, _I, _I, _F, _T],
    "rope": [_P, _I, _I, _I, _I, _P, _P, _T],
    "silu_mul": [_P, _P, _I, _I, _T],
}
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


class _Linear(ctypes.Structure):  # decode_one.c's struct linear
    _fields_ = [("weight", _P), ("scales", _P), ("bias", _P), ("pairs", _I)]


class _DecoderLayer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), *((name, _Linear) for name in ("qkv", "o", "gate_up", "down")),
                ("k_cache", _P), ("v_cache", _P)]  # fmt: skip


class _Decoder(ctypes.Structure):
    _fields_ = [*((name, _I) for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                          "block_size")),
                ("eps", _F), ("scale", _F), ("cos_sin", _P), ("final_norm", _P),
                ("layers", ctypes.POINTER(_DecoderLayer))]  # fmt: skip


class LinearWeights(NamedTuple):
    """What the one-token decoder reads of a linear layer: a bfloat16 weight ``[out, in]`` (or, with
    ``pairs``, the same in ``pack_pairs``'s layout), or an int8 one with bfloat16 ``scales`` ``[out]`` per
    row; ``bias`` ``[out]`` bfloat16 or None."""

    weight: torch.Tensor
    scales: torch.Tensor | None
    bias: torch.Tensor | None
    pairs: bool = False


class DecoderLayerWeights(NamedTuple):
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: LinearWeights  # q heads, then k, then v
    o: LinearWeights
    gate_up: LinearWeights  # gate rows, then up
    down: LinearWeights
    kv_cache: torch.Tensor  # [2, blocks, block_size, kv_heads, head_dim]


class OneTokenDecoder:
    """A decoding step of one sequence through every layer in one native call (``decode_one.c``).

    Holds the weights and caches it points at, so they outlive it.
    """

    def __init__(self, fn, decoder: _Decoder, keep: list) -> None:
        self._fn, self._decoder, self._keep = fn, decoder, keep

    def __call__(self, x: torch.Tensor, position: int, block_table: torch.Tensor) -> torch.Tensor:
        """The final hidden state ``[1, hidden]`` of the token whose embedding is ``x`` ``[1, hidden]``
        (overwritten), at ``position`` of the sequence whose block table ``block_table`` (int64) covers it."""
        if x.shape != (1, self._decoder.hidden) or x.dtype != torch.bfloat16 or not x.is_contiguous():
            raise ValueError("one-token decoder: x must be one contiguous bfloat16 row of the hidden size")
        if block_table.dtype != torch.int64 or block_table.numel() * self._decoder.block_size <= position:
            raise ValueError("one-token decoder: the block table must be int64 and cover the position")
        table = block_table.contiguous()
        self._fn(ctypes.byref(self._decoder), x.data_ptr(), position, table.data_ptr(), torch.get_num_threads())
        return x


class CpuKernels:
    """The loaded library: bfloat16 and float32 CPU tensors.

    The kernels trust their inputs past the checks below: the engine (block
    manager, model code) builds every table, slot and position they read.
    """

    def __init__(self, lib: ctypes.PyDLL) -> None:
        self._fns = {}
        for name, argtypes in _SIGNATURES.items():
            for dtype, suffix in _SUFFIX.items():
                fn = getattr(lib, f"{name}_{suffix}")
                fn.argtypes, fn.restype = argtypes, None
                self._fns[name, dtype] = fn
        # bfloat16 only: the plain weights kept for batch 1 (packed.py), PyTorch's int8 kernel's activations
        self._int8_linear = lib.int8_linear_bf16
        self._int8_linear.argtypes, self._int8_linear.restype = [_P, _I, _P, _P, _I, _P, _T], None
        self._gemv = lib.bf16_gemv
        self._gemv.argtypes, self._gemv.restype = [_P, _I, _P, _P, _I, _P, _T], None
        self._write_kv = lib.write_kv
        self._write_kv.argtypes, self._write_kv.restype = [_P, _P, _P, _P, _I, _P, _I, _I], None
        self._pairs_supported = bool(lib.bf16_pairs_supported())
        self._pack_pairs = lib.bf16_pack_pairs
        self._pack_pairs.argtypes, self._pack_pairs.restype = [_P, _I, _I, _P, _T], None
        self._gemm_pairs = lib.bf16_gemm_pairs
        self._gemm_pairs.argtypes, self._gemm_pairs.restype = [_P, _I, _I, _P, _P, _I, _P, _T], None
        self._prefill = lib.paged_prefill_bf16
        self._prefill.argtypes = [_P, _I, _P, _P, _P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _F, _T]
        self._prefill.restype = ctypes.c_int
        self._decode_one = lib.decode_one_bf16
        self._decode_one.argtypes, self._decode_one.restype = [ctypes.POINTER(_Decoder), _P, _I, _P, _T], None

    @staticmethod
    def supports(*tensors: torch.Tensor) -> bool:
        """Whether these tensors can go to the kernels: CPU, one dtype, bfloat16 or float32."""
        dtype = tensors[0].dtype
        return dtype in _SUFFIX and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)

    def decode_attention(
        self, query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """One query token per sequence over the paged cache.

        ``query`` ``[B, H, D]`` (each token's heads contiguous; the token axis
        may be strided, as in a view of the fused QKV output); ``kv_cache``
        ``[2, blocks, block_size, KVH, D]`` contiguous; ``block_tables``
        ``[B, max_blocks]`` int64; ``lens`` ``[B]`` int64, each in
        ``[1, max_blocks * block_size]``. Returns ``[B, H, D]`` contiguous.
        """
        batch, num_heads, head_dim = query.shape
        _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
        if cache_dim != head_dim or num_heads % num_kv_heads or lens.shape != (batch,):
            raise ValueError("decode attention: query, cache and lens shapes disagree")
        if not kv_cache.is_contiguous() or block_tables.dtype != torch.int64 or lens.dtype != torch.int64:
            raise ValueError("decode attention: the cache must be contiguous, tables and lens int64")
        if query.stride(2) != 1 or query.stride(1) != head_dim:
            query = query.contiguous()
        block_tables, lens = block_tables.contiguous(), lens.contiguous()
        out = query.new_empty(query.shape)
        self._fns["paged_decode", query.dtype](
            query.data_ptr(), query.stride(0), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
            block_tables.data_ptr(), block_tables.shape[1], lens.data_ptr(), out.data_ptr(),
            batch, num_heads, num_kv_heads, head_dim, block_size, scale, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def prefill_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> bool:
        """Causal attention of prefilling sequences over the cache, into ``out``; False where the kernel does
        not apply (not bfloat16, no AVX512-BF16, head dims not a multiple of 64): ``out`` is then untouched.

        ``query`` ``[T, H, D]`` holds the sequences' new tokens one after the other (each token's heads
        contiguous; the token axis may be strided); their K/V are already in ``kv_cache``. ``seq_lens``
        ``[3, S]`` int64: each sequence's first row in ``query``, its new tokens, and its context (cached
        tokens + new); ``block_tables`` ``[S, max_blocks]``. ``out`` contiguous, ``[T', H, D]`` with
        ``T' >= T``: the sequences' rows are written, any after them left alone.
        """
        num_heads, head_dim = query.shape[1:]
        _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
        if query.dtype != torch.bfloat16 or cache_dim != head_dim or num_heads % num_kv_heads:
            return False
        if not kv_cache.is_contiguous() or not out.is_contiguous():
            raise ValueError("prefill attention: the cache and out must be contiguous")
        if out.shape[0] < query.shape[0] or out.shape[1:] != query.shape[1:]:
            raise ValueError("prefill attention: out must have the query's heads and at least its rows")
        if seq_lens.dtype != torch.int64 or seq_lens.shape != (3, block_tables.shape[0]):
            raise ValueError("prefill attention: seq_lens must be int64 [3, sequences]")
        if query.stride(2) != 1 or query.stride(1) != head_dim:
            query = query.contiguous()
        block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
        starts, q_lens, ctx_lens = seq_lens
        return bool(self._prefill(
            query.data_ptr(), query.stride(0), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
            block_tables.data_ptr(), block_tables.shape[1], starts.data_ptr(), q_lens.data_ptr(),
            ctx_lens.data_ptr(), block_tables.shape[0], out.data_ptr(), num_heads, num_kv_heads, head_dim,
            block_size, scale, torch.get_num_threads(),
        ))  # fmt: skip

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """``kv_cache[0]``'s and ``kv_cache[1]``'s flat slot ``slots[t]`` = token t's ``key`` and ``value``
        ``[T, kv_heads, head_dim]`` (each token's heads contiguous; the token axis may be strided, as in views
        of the fused QKV output, the same for both), as ``attention.write_kv_cache`` does."""
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        if key.shape != (key.shape[0], num_kv_heads, head_dim) or value.shape != key.shape:
            raise ValueError("write_kv: key, value and cache shapes disagree")
        if key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype or not kv_cache.is_contiguous():
            raise ValueError("write_kv: key and value must have the cache's dtype, the cache be contiguous")
        if key.stride()[1:] != (head_dim, 1) or value.stride() != key.stride():
            raise ValueError("write_kv: each token's heads must be contiguous, key and value alike")
        if slots.dtype != torch.int64 or slots.shape != (key.shape[0],):
            raise ValueError("write_kv: slots must be int64 [tokens]")
        slots = slots.contiguous()
        size = key.element_size()
        self._write_kv(
            kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), key.data_ptr(), value.data_ptr(), key.stride(0) * size,
            slots.data_ptr(), key.shape[0], num_kv_heads * head_dim * size,
        )  # fmt: skip

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """RMSNorm of ``x`` ``[..., hidden]`` (contiguous), as models.llama.RMSNorm computes it.

        With ``residual`` (same shape, contiguous), first ``residual += x`` in
        place, rounded to the dtype, and the norm is taken of the new residual.
        """
        hidden = x.shape[-1]
        if not x.is_contiguous() or (residual is not None and (residual.shape != x.shape or not residual.is_contiguous())):
            raise ValueError("rms_norm: x and residual must be contiguous and of one shape")
        out = torch.empty_like(x)
        self._fns["add_rms_norm", x.dtype](
            x.data_ptr(), None if residual is None else residual.data_ptr(), weight.contiguous().data_ptr(),
            out.data_ptr(), x.numel() // hidden, hidden, eps, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def rope_(self, x: torch.Tensor, heads: int, head_dim: int, cos_sin: torch.Tensor, positions: torch.Tensor) -> None:
        """Rotate-half RoPE in place on the first ``heads`` heads of each row of ``x`` ``[T, width]``.

        The rows may be strided (a fused QKV output's q and k part); ``cos_sin``
        ``[max_positions, head_dim]`` float32, cos then sin; ``positions`` ``[T]`` int64.
        """
        if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] < heads * head_dim or head_dim % 2:
            raise ValueError("rope: x must be [tokens, width] with unit column stride")
        if cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous() or cos_sin.shape[1] != head_dim:
            raise ValueError("rope: cos_sin must be contiguous float32 [positions, head_dim]")
        if positions.dtype != torch.int64 or positions.shape != (x.shape[0],):
            raise ValueError("rope: positions must be int64 [tokens]")
        positions = positions.contiguous()
        self._fns["rope", x.dtype](
            x.data_ptr(), x.shape[0], x.stride(0), heads, head_dim, cos_sin.data_ptr(), positions.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up`` ``[..., 2 * inner]`` (contiguous), as models.llama.MLP computes it."""
        if not gate_up.is_contiguous() or gate_up.shape[-1] % 2:
            raise ValueError("silu_mul: gate_up must be contiguous with an even last axis")
        inner = gate_up.shape[-1] // 2
        out = gate_up.new_empty((*gate_up.shape[:-1], inner))
        self._fns["silu_mul", gate_up.dtype](
            gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inner), inner, torch.get_num_threads()
        )
        return out

    def int8_linear(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``x W^T`` for one bfloat16 row ``x`` ``[1, K]``, ``W`` = int8 ``qweight`` ``[N, K]`` times bfloat16
        ``scales`` ``[N]`` per row, as ``aten._weight_int8pack_mm`` computes it. Returns ``[1, N]`` bfloat16."""
        if x.shape[0] != 1 or x.dtype != torch.bfloat16 or qweight.dtype != torch.int8 or scales.dtype != torch.bfloat16:
            raise ValueError("int8_linear: x must be one bfloat16 row, qweight int8, scales bfloat16")
        if x.shape[1] != qweight.shape[1] or scales.shape != (qweight.shape[0],) or not qweight.is_contiguous():
            raise ValueError("int8_linear: x, qweight and scales shapes disagree")
        x, scales = x.contiguous(), scales.contiguous()
        out = x.new_empty((1, qweight.shape[0]))
        self._int8_linear(
            x.data_ptr(), x.shape[1], qweight.data_ptr(), scales.data_ptr(), qweight.shape[0], out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def gemv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T + b`` for one bfloat16 row ``x`` ``[1, K]``, ``weight`` ``[N, K]`` and ``bias`` ``[N]``
        bfloat16, summed in float32 and rounded once, as oneDNN's linear does. Returns ``[1, N]``."""
        if x.shape[0] != 1 or not all(t.dtype == torch.bfloat16 for t in (x, weight, *([bias] if bias is not None else []))):
            raise ValueError("gemv: x must be one bfloat16 row, weight and bias bfloat16")
        if x.shape[1] != weight.shape[1] or not weight.is_contiguous() or (bias is not None and bias.shape != (weight.shape[0],)):
            raise ValueError("gemv: x, weight and bias shapes disagree (or the weight is not contiguous)")
        x = x.contiguous()
        out = x.new_empty((1, weight.shape[0]))
        self._gemv(
            x.data_ptr(), x.shape[1], weight.data_ptr(), None if bias is None else bias.contiguous().data_ptr(),
            weight.shape[0], out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out

    def pack_pairs(self, weight: torch.Tensor) -> torch.Tensor | None:
        """A copy of a bfloat16 ``weight`` ``[N, K]`` with its elements in ``gemm_pairs``'s layout (the same
        shape, so only these kernels can read it), or None where that kernel does not run: no AVX512-BF16, or
        N not a multiple of 32, or K odd."""
        out_features, in_features = weight.shape
        if not self._pairs_supported or weight.dtype != torch.bfloat16 or out_features % 32 or in_features % 2:
            return None
        weight = weight.contiguous()
        pairs = torch.empty_like(weight)
        self._pack_pairs(weight.data_ptr(), out_features, in_features, pairs.data_ptr(), torch.get_num_threads())
        return pairs

    def gemm_pairs(
        self, x: torch.Tensor, pairs: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x W^T + b`` for a few bfloat16 rows ``x`` ``[M, K]``, with W ``[out_features, K]`` as
        ``pack_pairs`` made it and ``bias`` ``[out_features]`` bfloat16; float32 sums rounded once. ``[M, N]``."""
        rows, in_features = x.shape
        if x.dtype != torch.bfloat16 or pairs.dtype != torch.bfloat16 or pairs.numel() != out_features * in_features:
            raise ValueError("gemm_pairs: x and the packed weight must be bfloat16 and of agreeing shapes")
        if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (out_features,)):
            raise ValueError("gemm_pairs: bias must be bfloat16 [out_features]")
        x = x.contiguous()
        out = x.new_empty((rows, out_features))
        self._gemm_pairs(
            x.data_ptr(), rows, in_features, pairs.data_ptr(), None if bias is None else bias.contiguous().data_ptr(),
            out_features, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out

    def one_token_decoder(
        self,
        layers: list[DecoderLayerWeights],
        final_norm: torch.Tensor,
        cos_sin: torch.Tensor,
        *,
        heads: int,
        eps: float,
        scale: float,
    ) -> OneTokenDecoder:
        """A one-call decoding step over these bfloat16 weights and caches (models/llama.py builds it).

        Every tensor must be contiguous, the norms, biases, scales and caches
        bfloat16, ``cos_sin`` float32 ``[positions, head_dim]``.
        """
        _, _, block_size, kv_heads, head_dim = layers[0].kv_cache.shape
        hidden, intermediate = final_norm.shape[0], layers[0].down.weight.shape[1]
        expected = {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
                    "gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}  # fmt: skip
        keep = [final_norm, cos_sin]
        structs = []
        for layer in layers:
            for name, shape in expected.items():
                w = getattr(layer, name)
                int8 = w.weight.dtype == torch.int8
                if (w.scales is not None) != int8 or w.weight.dtype not in (torch.bfloat16, torch.int8):
                    raise ValueError(f"one-token decoder: {name} must be bfloat16, or int8 with scales")
                if tuple(w.weight.shape) != shape:
                    raise ValueError(f"one-token decoder: {name} has shape {tuple(w.weight.shape)}, expected {shape}")
            cache = layer.kv_cache
            if cache.shape != layers[0].kv_cache.shape:
                raise ValueError("one-token decoder: the layers' caches differ in shape")
            bf16 = [layer.input_norm, layer.post_norm, cache]
            bf16 += [t for name in expected for t in getattr(layer, name)[1:3] if t is not None]  # scales, biases
            tensors = bf16 + [getattr(layer, name).weight for name in expected]
            if any(t.dtype != torch.bfloat16 for t in bf16) or any(
                t.device.type != "cpu" or not t.is_contiguous() for t in tensors
            ):
                raise ValueError("one-token decoder: tensors must be contiguous on the CPU, bfloat16 but int8 weights")
            keep.extend(tensors)
            linears = {name: _Linear(*(_ptr(t) for t in getattr(layer, name)[:3]), getattr(layer, name).pairs)
                       for name in expected}  # fmt: skip
            structs.append(_DecoderLayer(_ptr(layer.input_norm), _ptr(layer.post_norm), **linears,
                                         k_cache=cache[0].data_ptr(), v_cache=cache[1].data_ptr()))  # fmt: skip
        if final_norm.dtype != torch.bfloat16 or not final_norm.is_contiguous():
            raise ValueError("one-token decoder: the final norm's weight must be contiguous bfloat16")
        if cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous() or cos_sin.shape[1] != head_dim:
            raise ValueError("one-token decoder: cos_sin must be contiguous float32 [positions, head_dim]")
        array = (_DecoderLayer * len(structs))(*structs)
        keep.append(array)
        decoder = _Decoder(len(layers), hidden, heads, kv_heads, head_dim, intermediate, block_size, eps, scale,
                           cos_sin.data_ptr(), final_norm.data_ptr(), array)  # fmt: skip
        return OneTokenDecoder(self._decode_one, decoder, keep)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def reference_decode_attention(query, kv_cache, block_tables, lens, scale):
    """Decode attention in float64 PyTorch: the self-check's expectation, and bench/kernels.py's."""
    block_size = kv_cache.shape[2]
    group = query.shape[1] // kv_cache.shape[3]
    flat = kv_cache.flatten(1, 2).double()
    outs = []
    for b, n in enumerate(lens.tolist()):
        slots = [block_tables[b, t // block_size] * block_size + t % block_size for t in range(n)]
        k = flat[0, slots].repeat_interleave(group, 1)  # [n, H, D]
        v = flat[1, slots].repeat_interleave(group, 1)
        weights = (torch.einsum("hd,nhd->hn", query[b].double(), k) * scale).softmax(-1)
        outs.append(torch.einsum("hn,nhd->hd", weights, v))
    return torch.stack(outs)


def _self_check(kernels: CpuKernels) -> None:
    """Each kernel against plain PyTorch on a small case, in both dtypes; RuntimeError on a mismatch."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 6, 4, 2, 16, generator=gen)
    tables, lens = torch.tensor([[5, 1, 3], [0, 2, 4]]), torch.tensor([11, 3])
    query = torch.randn(2, 6, 16, generator=gen)
    x, res, w = torch.randn(3, 40, generator=gen), torch.randn(3, 40, generator=gen), torch.randn(40, generator=gen)
    cos_sin, positions = torch.randn(9, 8, generator=gen), torch.tensor([4, 0, 8])
    cos, sin = cos_sin[positions, None].chunk(2, -1)
    x1, x2 = x[:, :16].view(3, 2, 8).chunk(2, -1)
    checks = {
        "decode_attention": (
            lambda dt: kernels.decode_attention(query.to(dt), cache.to(dt), tables, lens, 0.25),
            reference_decode_attention(query, cache, tables, lens, 0.25),
        ),
        "rms_norm": (
            lambda dt: kernels.rms_norm(x.to(dt), w.to(dt), 1e-5, res.to(dt).clone()),
            w * (res + x) * torch.rsqrt((res + x).pow(2).mean(-1, keepdim=True) + 1e-5),
        ),
        "rope_": (
            lambda dt: _rotated(kernels, x.to(dt, copy=True), cos_sin, positions),
            torch.cat([torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).view(3, 16), x[:, 16:]], -1),
        ),
        "silu_mul": (lambda dt: kernels.silu_mul(x.to(dt)), torch.nn.functional.silu(x[:, :20]) * x[:, 20:]),
        "write_kv": (  # rows 0 and 1 of x as three tokens' K and V heads, into slots 5, 0, 2 of a zero cache
            lambda dt: _written(kernels, x.to(dt), torch.tensor([5, 0, 2])),
            torch.zeros(2, 6, 16).index_copy_(1, torch.tensor([5, 0, 2]), x[:, :32].view(3, 2, 16).transpose(0, 1)),
        ),
    }
    qweight = torch.randint(-127, 128, (12, 40), generator=gen, dtype=torch.int8)
    scales = torch.rand(12, generator=gen).to(torch.bfloat16)
    row = x[:1].to(torch.bfloat16)
    int8_expected = row.double() @ (qweight.double() * scales.double()[:, None]).T
    checks["int8_linear"] = (lambda dt: kernels.int8_linear(row, qweight, scales), int8_expected)
    weight, bias = (qweight.double() * scales.double()[:, None]).to(torch.bfloat16), res[0, :12].to(torch.bfloat16)
    gemv_expected = row.double() @ weight.double().T + bias.double()
    checks["gemv"] = (lambda dt: kernels.gemv(row, weight, bias), gemv_expected)
    wide = torch.cat([weight, weight.flip(0), weight[:8]])  # 32 outputs: one block pair of the pair layout
    pairs = kernels.pack_pairs(wide)
    if pairs is not None:
        rows, wide_bias = x.to(torch.bfloat16), torch.cat([bias, bias, bias[:8]])
        pairs_expected = rows.double() @ wide.double().T + wide_bias.double()
        checks["gemm_pairs"] = (lambda dt: kernels.gemm_pairs(rows, pairs, 32, wide_bias), pairs_expected)
    _check_prefill(kernels, gen)
    for name, (run, expected) in checks.items():
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
            if name in ("int8_linear", "gemv", "gemm_pairs"):
                tol = 1e-2  # bfloat16 in and out whatever the model's dtype
            got = run(dtype).double()
            if got.shape != expected.shape:
                raise RuntimeError(f"{name} in {dtype} differs from PyTorch's in shape: {tuple(got.shape)}")
            if not torch.allclose(got, expected.double(), atol=tol, rtol=tol):
                raise RuntimeError(f"{name} in {dtype} differs from PyTorch's by {(got - expected).abs().max():.3g}")


def _check_prefill(kernels: CpuKernels, gen: torch.Generator) -> None:
    """The prefill kernel where it applies (bfloat16, 64-dim heads): token i of a sequence's new tokens attends
    like a decoding token at position ``context - new + i``."""
    cache = torch.randn(2, 6, 4, 2, 64, generator=gen).to(torch.bfloat16)
    tables = torch.tensor([[5, 1, 3], [0, 2, 4]])
    seq_lens = torch.tensor([[0, 5], [5, 2], [11, 3]])  # first rows, new tokens, contexts: 5 of 11, 2 of 3
    query = torch.randn(7, 6, 64, generator=gen).to(torch.bfloat16)
    out = query.new_zeros(query.shape)
    if not kernels.prefill_attention(query, cache, tables, seq_lens, 0.125, out):
        return
    token_tables, token_lens = tables[[0] * 5 + [1] * 2], torch.tensor([7, 8, 9, 10, 11, 2, 3])
    expected = reference_decode_attention(query, cache, token_tables, token_lens, 0.125)
    if not torch.allclose(out.double(), expected, atol=3e-2, rtol=3e-2):
        error = (out.double() - expected).abs().max()
        raise RuntimeError(f"prefill_attention in torch.bfloat16 differs from PyTorch's by {error:.3g}")


def _written(kernels: CpuKernels, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    cache = x.new_zeros(2, 3, 2, 1, 16)  # 6 slots of one 16-dim head
    kernels.write_kv(cache, x[:, :16].view(3, 1, 16), x[:, 16:32].view(3, 1, 16), slots)
    return cache.view(2, 6, 16)


def _rotated(kernels: CpuKernels, x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    kernels.rope_(x, 2, 8, cos_sin, positions)
    return x


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The CPU kernels, built and checked on first call; None where they cannot be had."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        logger.warning("no C compiler (%s) found: servelm's CPU kernels are off, PyTorch's slower ops run instead", compiler)
        return None
    try:
        kernels = CpuKernels(ctypes.PyDLL(str(_build(compiler))))
        _self_check(kernels)
    except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("servelm's CPU kernels are unavailable, PyTorch's slower ops run instead: %s", exc)
        return None
    return kernels


def for_tensors(*tensors: torch.Tensor) -> CpuKernels | None:
    """The kernels if they are built and take these tensors (CPU, one dtype, bfloat16 or float32), else None."""
    if tensors[0].device.type != "cpu":
        return None
    native = cpu_kernels()
    return native if native is not None and native.supports(*tensors) else None
