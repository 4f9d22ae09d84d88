"""Native CPU kernels, compiled on first use and registered as PyTorch ops (``torch.ops.servelm``).

- ``paged_attention.c``: decode attention over the paged KV cache. PyTorch has
  no CPU kernel for it: the portable path gathers every sequence's keys and
  values into a dense copy and calls SDPA, whose CPU kernel spends most of its
  time on per-head overhead when each sequence has one query token. This one
  reads the cache blocks in place. A sequence past 512 keys is split into
  parts that the threads share, merged by their softmax sums
  (``decode_plan.c``, which paged_attention.c and kv_int8.c share).
- ``prefill_attention.c``: prefill attention (bfloat16 on AVX512-BF16 CPUs):
  every prefilling sequence of a step in one call, causal over its cached
  prefix and its new tokens, where PyTorch gathers and calls SDPA per
  sequence.
- ``fused_ops.c``: the decoder's elementwise chains (residual add + RMSNorm,
  RoPE on q and k, SiLU * up), one call each instead of up to 20 small
  PyTorch ops, whose per-op overhead dominates a small batch; the copy of
  a step's K/V rows into their cache slots; and the sampler's one pass over
  each row of logits (its largest value, where, and the log-softmax's
  logsum) instead of a whole log-softmax written out.
- ``kv_int8.c``: the int8 KV cache (``--kv-cache-dtype int8``): rounding a
  step's K/V rows into it, and decode attention over it (prefill's is in
  prefill_attention.c), reading half the bytes of a bfloat16 cache.
- ``attention_pairs.c``: prefill attention's weighted values, the values
  and the softmax's weights laid out in pairs of keys for ``vdpbf16ps``.
- ``attention_amx.c``: attention's scores (q . k) on AMX tiles where the
  CPU has them, for decoding (a 16-token cache block at a time) and prefill,
  and prefill's weighted values; the bfloat16 attention kernels ask it
  first.
- ``gemv.c``: matrix-vector products for batch-1 decoding, bfloat16,
  float32 and int8 weights, streaming each weight row once at close to
  memory speed (bfloat16 and float32 for a few rows too, each row summed as
  when alone).
- ``gemm_pairs.c``: a small GEMM for decoding a few dozen sequences over
  weights in its own pair layout (AVX512-BF16, and on AMX CPUs the tile
  unit, whose own layout it is).
- ``amx.c``: what the AMX kernels share: Linux's permission to use the
  tiles, and the tile configuration.
- ``w8a8.c``: an int8 x int8 GEMM for ``--quantization w8a8`` on AVX512-VNNI
  CPUs (``vpdpbusd``), and on AMX-INT8 tiles (``tdpbssd``, ``w8a8_amx.c``)
  from 8 rows where the CPU has them (``w8a8.h``: what both share): each row
  of the activations rounded to int8 on the fly, the weights packed once at
  load (one layout serves both), int32 sums scaled back once per output
  (``bench/w8a8_gemm.py``).
- ``decode_step.c``: a whole decoding step of a Llama-family model (one new
  token for each of a batch of sequences) in one call, running the kernels
  above layer after layer: decoding's ops are small, and the Python around a
  few hundred of them a step costs as much as, or a good part of, the ops
  themselves.

``ops.cpp``, ``attention_op.cpp`` and ``decoder_op.cpp`` register them as ops with schemas, each
checking its arguments before C reads them; ``ops.py`` is their typed Python
face, ``build.py`` compiles and caches the library, ``self_check.py`` checks
a loaded build against PyTorch before it is used (bench/kernels.py measures
each kernel against the PyTorch path). Without a compiler, or if the build or
the check fails, ``cpu_kernels()`` returns None (with one warning) and
callers keep the PyTorch path.
"""

from __future__ import annotations

import functools
import logging
import subprocess

import torch

from servelm.kernels import build
from servelm.kernels.ops import CpuKernels, DecoderLayerWeights, DecodingStep, LinearWeights
from servelm.kernels.self_check import reference_decode_attention, self_check

__all__ = [
    "CpuKernels",
    "DecoderLayerWeights",
    "DecodingStep",
    "LinearWeights",
    "cpu_kernels",
    "for_cache",
    "for_tensors",
    "reference_decode_attention",
]

logger = logging.getLogger(__name__)


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The CPU kernels, built, loaded and checked on first call; None where they cannot be had."""
    try:
        path = build.build(*build.compilers())
        build.load(path)
        kernels = CpuKernels()
        self_check(kernels)
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as exc:  # BuildError: RuntimeError
        logger.warning("servelm's CPU kernels are unavailable, PyTorch's slower ops run instead: %s", exc)
        return None
    return kernels


def for_tensors(*tensors: torch.Tensor) -> CpuKernels | None:
    """The kernels if they are built and take these tensors (CPU, one dtype, bfloat16 or float32), else None."""
    if tensors[0].device.type != "cpu":
        return None
    native = cpu_kernels()
    return native if native is not None and native.supports(*tensors) else None


def for_cache(x: torch.Tensor, kv_cache: torch.Tensor) -> CpuKernels | None:
    """The kernels if they are built and their attention ops take ``x`` with ``kv_cache``
    (``CpuKernels.supports_cache``), else None."""
    if x.device.type != "cpu":
        return None
    native = cpu_kernels()
    return native if native is not None and native.supports_cache(x, kv_cache) else None
