"""How a loaded model's linear weights are laid out in memory for the device: one entry point,
``lay_out_weights``, which the model runner calls once after loading.

On the CPU, in order:

- ``quantization="int8"``: every linear layer becomes an :class:`Int8Linear`
  (quantization.py); ``quantization="w8a8"``: a :class:`W8A8Linear` (w8a8.py);
- else, where this torch build packs the model's weights (bfloat16 or float32)
  for oneDNN, every linear layer becomes a :class:`PackedLinear` (packed.py),
  keeping a second copy of its weight for decoding where it fits in memory: in
  bfloat16 in the small-GEMM kernel's pair layout for as many rows as
  ``cpu_matmul`` says (``pair_rows``), else plain for batch 1 (and on AVX2
  CPUs for a few rows more: ``plain_rows``);
- then the weights decoding streams every step (pair layout, plain, int8 rows) move
  onto transparent huge pages (``servelm.platform.memory``).

Elsewhere (CUDA, a torch build without oneDNN, float16) the model keeps its
``nn.Linear`` layers as loaded.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
from torch import nn

from servelm.models.packed import PackedLinear, can_pack, packed_dtype, pair_rows, replace_linears
from servelm.models.quantization import Int8Linear, quantize_int8
from servelm.models.w8a8 import W8A8Linear, quantize_w8a8
from servelm.platform.memory import huge_page_copies

logger = logging.getLogger(__name__)


def free_memory_bytes(device: torch.device) -> int:
    """The memory free on ``device`` now: the GPU's, or the machine's available RAM."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return available_ram_bytes()


def available_ram_bytes(meminfo: str = "/proc/meminfo") -> int:
    """The RAM the kernel can hand out now without swapping: Linux's ``MemAvailable``, its free pages plus
    the page cache and other memory it can reclaim, else (no such line) the free pages alone. The free pages
    alone undercount it by the page cache: with 5 GB free of 18 GB available on a 24 GB machine (the
    benchmark's model files just written), the Llama-3.2-1B shape in bfloat16 went without its decoding copy
    and decoded on oneDNN alone, 2-3x slower (docs/BENCHMARKS.md)."""
    try:
        with open(meminfo) as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # in kB
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def lay_out_weights(model: nn.Module, quantization: str, cpu_matmul: str) -> None:
    """Replace ``model``'s linear layers by the layout that runs fastest where it lives, in place.

    ``quantization`` is ``none``, ``int8`` or ``w8a8`` (the last two CPU only: ValueError elsewhere);
    ``cpu_matmul`` (``auto``, ``onednn`` or ``pairs``) picks the products of decoding's few rows on CPU
    (``packed.pair_rows``).
    """
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    if device.type != "cpu":  # every layout below is for CPUs
        if quantization != "none":
            raise ValueError(
                f"quantization {quantization} runs on CPU only (its kernels are CPU ones); the device is {device}"
            )
        return
    if quantization == "int8":
        count = quantize_int8(model, _tied_head(model))
        logger.info("quantized %d linear layers to int8 (weight-only)", count)
    elif quantization == "w8a8":
        count = quantize_w8a8(model, _tied_head(model))
        logger.info("quantized %d linear layers to int8 weights and activations (w8a8)", count)
    elif can_pack(dtype, device):
        _pack(model, device, dtype, cpu_matmul)
    _stream_from_huge_pages(model, device)


def _pack(model: nn.Module, device: torch.device, dtype: torch.dtype, cpu_matmul: str) -> None:
    # Decoding reads a second copy of the weights faster than oneDNN's packed one (packed.py): in bfloat16 in
    # the small-GEMM kernel's pair layout where cpu_matmul says so (with a tied head's too), else plain for
    # batch 1 (a tied head's plain weight is the embedding). It is kept only while it takes at most a quarter
    # of the free memory.
    plain_bytes = sum(m.weight.nbytes for m in model.modules() if isinstance(m, nn.Linear))
    head = _tied_head(model)
    with_head = plain_bytes + (head.nbytes if head is not None else 0)
    free = free_memory_bytes(device)
    wide = packed_dtype(dtype)
    if wide != dtype:  # bfloat16 layers packed in float32 (packed.py): twice the bytes, beside the model's own
        packed_bytes = with_head * wide.itemsize // dtype.itemsize
        if packed_bytes > free // 2:
            logger.warning(
                "the bfloat16 layers stay unpacked: their float32 copies for oneDNN (%.1f GB) do not fit in half of "
                "the free memory, and oneDNN emulates bfloat16 on this CPU, several times slower",
                packed_bytes / 1e9,
            )
            return
    budget = free // 4
    fits_pairs = with_head <= budget
    rows = pair_rows(cpu_matmul) if fits_pairs and dtype == torch.bfloat16 else 0  # no float32 pair layout
    keep_plain = plain_bytes <= budget
    make = functools.partial(PackedLinear, keep_plain=keep_plain, pair_rows=rows)
    count = replace_linears(model, make, head)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    most = max((m.plain_rows for m in packed), default=0)
    kept = [
        what
        for what, attr in (
            ("the pair layout for decoding", "pair_weight"),
            ("plain weights for batch 1" if most == 1 else f"plain weights for up to {most} rows", "plain_weight"),
        )
        if any(getattr(m, attr) is not None for m in packed)
    ]
    widened = f" in {str(wide).removeprefix('torch.')}" if wide != dtype else ""
    logger.info(
        "prepacked %d linear layers for oneDNN%s%s", count, widened, f" (kept: {', '.join(kept)})" if kept else ""
    )


def _stream_from_huge_pages(model: nn.Module, device: torch.device) -> None:
    # Decoding streams the pair-layout, plain, int8 or W8A8-packed weights of every layer once per step. On
    # transparent huge pages it takes a TLB miss every 2 MiB instead of every 4 KiB (servelm/platform/memory.py).
    owners = [
        (m, attr)
        for m in model.modules()
        for attr in ("plain_weight", "pair_weight")
        if getattr(m, attr, None) is not None
    ]
    owners += [(m, "qweight") for m in model.modules() if isinstance(m, (Int8Linear, W8A8Linear))]
    owners += [(m, "packed") for m in model.modules() if isinstance(m, W8A8Linear) and m.packed is not None]
    nbytes = sum(getattr(m, a).nbytes for m, a in owners)
    if not owners or nbytes > free_memory_bytes(device) // 2:  # the old copies go only once all are made
        return
    for (module, attr), copy in zip(owners, huge_page_copies([getattr(m, a) for m, a in owners])):
        setattr(module, attr, copy)
    head = model.lm_head
    if model.config.tie_word_embeddings and getattr(head, "plain_weight", None) is not None:
        # The head's plain weight was the embedding itself: keep it so, with no second copy.
        model.model.embed_tokens.weight = nn.Parameter(head.plain_weight, requires_grad=False)


def _tied_head(model: nn.Module) -> torch.Tensor | None:
    """The embedding's weight when the LM head is tied to it (no head module of its own), else None."""
    return model.model.embed_tokens.weight if model.lm_head is None else None
