"""Weights and config from a single GGUF file (llama.cpp's format).

Every tensor is dequantized to float32 with the ``gguf`` library's numpy
kernels, renamed to its HF name and handed to ``LlamaForCausalLM.load_weights``,
so the model code knows nothing of GGUF.
"""

from __future__ import annotations

import mmap
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quant_shape_to_byte_shape

from servelm.models.config import ModelConfig, UnsupportedModelError
from servelm.models.llama import LlamaForCausalLM, build_empty_model

# GGUF per-layer tensor -> HF module path inside model.layers.N
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# Arrays longer than this (vocabularies, merges, scores) are read as None:
# decoding them costs seconds and the tokenizer reads them itself.
_MAX_DECODED_ARRAY = 1024

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, not yet dequantized."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy/HF order: rows (output features) first
    data: np.ndarray  # raw bytes, or F32/F16 values; a view of the mapped file


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata and tensor table."""

    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]


def load_gguf_model(path: str | Path, dtype: torch.dtype, device: torch.device) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Model and config from a .gguf file; the tokenizer is loaded separately."""
    gguf_file = read_gguf(path)
    meta, tensors = gguf_file.metadata, gguf_file.tensors
    arch = meta.get("general.architecture")
    if meta.get(f"{arch}.vocab_size") is None and "token_embd.weight" in tensors:
        meta[f"{arch}.vocab_size"] = tensors["token_embd.weight"].shape[0]
    config = ModelConfig.from_gguf_metadata(meta, set(tensors))
    model = build_empty_model(config, dtype, device)
    # convert_hf_to_gguf interleaves q/k rows for llama.cpp's RoPE only for the
    # llama architecture; qwen2/qwen3 keep HF's rotate-half layout.
    unpermute = arch == "llama"
    model.load_weights(_hf_tensors(tensors, config, unpermute))
    if "rope_freqs.weight" in tensors:
        # Llama 3.1-style scaling, precomputed by the converter as per-frequency divisors.
        model.rotary.init_cache(torch.from_numpy(dequantize(tensors["rope_freqs.weight"]).copy()))
    return model, config


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF header; tensor data stays in the memory-mapped file.

    ``gguf.GGUFReader`` would do, but it builds a numpy view per vocabulary
    string (seconds for a 50k vocabulary); this reads only what loading needs
    and skips long arrays, which the tokenizer reads itself.
    """
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(buf)
    magic, version, tensor_count, kv_count = cursor.unpack("4sIQQ")
    if magic != b"GGUF":
        raise UnsupportedModelError(f"{path} is not a GGUF file")
    if version not in (2, 3):
        raise UnsupportedModelError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    metadata = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("I")[0])
    table = []
    for _ in range(tensor_count):
        name = cursor.string()
        (n_dims,) = cursor.unpack("I")
        dims = cursor.unpack(f"{n_dims}Q")
        tensor_type, offset = cursor.unpack("IQ")
        table.append((name, dims, tensor_type, offset))
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = {name: _tensor(buf, data_start + offset, name, dims, kind) for name, dims, kind, offset in table}
    return GGUFFile(metadata, tensors)


class _Cursor:
    """Sequential little-endian reads over the mapped header."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        start, self.pos = self.pos, self.pos + length
        return self.buf[start : self.pos].decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[value_type])[0]
        if value_type != GGUFValueType.ARRAY:
            raise UnsupportedModelError(f"GGUF metadata value of unknown type {value_type}")
        item_type, count = self.unpack("IQ")
        if item_type in _SCALAR_FORMATS:
            values = self.unpack(f"{count}{_SCALAR_FORMATS[item_type]}")
            return list(values) if count <= _MAX_DECODED_ARRAY else None
        if item_type == GGUFValueType.STRING and count > _MAX_DECODED_ARRAY:
            for _ in range(count):  # skip, reading only the length prefixes
                (length,) = struct.unpack_from("<Q", self.buf, self.pos)
                self.pos += 8 + length
            return None
        return [self.value(item_type) for _ in range(count)]


def _tensor(buf: mmap.mmap, start: int, name: str, dims: tuple[int, ...], raw_type: int) -> GGUFTensor:
    try:
        tensor_type = GGMLQuantizationType(raw_type)
    except ValueError:
        raise UnsupportedModelError(f"GGUF tensor {name!r} has unknown type id {raw_type}") from None
    shape = tuple(reversed(dims))  # GGUF lists the fastest-varying dimension first
    if tensor_type == GGMLQuantizationType.F32:
        dtype, data_shape = np.float32, shape
    elif tensor_type == GGMLQuantizationType.F16:
        dtype, data_shape = np.float16, shape
    else:
        dtype, data_shape = np.uint8, quant_shape_to_byte_shape(shape, tensor_type)
    count = int(np.prod(data_shape))
    data = np.frombuffer(buf, dtype=dtype, count=count, offset=start).reshape(data_shape)
    return GGUFTensor(name, tensor_type, shape, data)


# Elements per row handed to the gguf library: it dequantizes 16 rows per numpy call, so a tensor's short
# rows cost a call per 16 (~13,000 calls for the bundled model); rows lie end to end in the file, so a
# few read as one long row give the same values in fewer calls.
_DEQUANTIZE_ROW = 4096


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """A GGUF tensor as float32 numpy of ``tensor.shape`` (may be a read-only view for F32)."""
    try:
        data = tensor.data
        if data.dtype == np.uint8 and data.ndim == 2:  # quantized rows: merge the most rows, a power of two
            rows, per = data.shape[0], 1
            while rows % (2 * per) == 0 and 2 * per * tensor.shape[-1] <= _DEQUANTIZE_ROW:
                per *= 2
            data = data.reshape(rows // per, per * data.shape[1])
        return gguf_dequantize(data, tensor.tensor_type).reshape(tensor.shape)
    except NotImplementedError:
        raise UnsupportedModelError(
            f"GGUF tensor {tensor.name!r} uses quantization {tensor.tensor_type.name}, "
            f"which the gguf library cannot dequantize"
        ) from None


def hf_name(gguf_name: str) -> str:
    """HF parameter name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise UnsupportedModelError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, part, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's q/k row permutation.

    The converter reorders each head's rows from rotate-half order (first half,
    second half) to interleaved pairs, for llama.cpp's RoPE; this puts them back.
    Works on weights ``[out, in]`` and biases ``[out]``.
    """
    half = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def _hf_tensors(
    tensors: dict[str, GGUFTensor], config: ModelConfig, unpermute: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 CPU tensor) for every parameter tensor of the file."""
    for gguf_name, tensor in tensors.items():
        if gguf_name == "rope_freqs.weight":
            continue
        array = dequantize(tensor)
        if unpermute and ".attn_q." in gguf_name:
            array = unpermute_qk(array, config.num_attention_heads)
        elif unpermute and ".attn_k." in gguf_name:
            array = unpermute_qk(array, config.num_key_value_heads)
        # The file is mapped read-only; torch wants a writable buffer, so copy when needed.
        # load_weights' copy_ does the cast and the move to the device.
        yield hf_name(gguf_name), torch.from_numpy(np.require(array, requirements=["C_CONTIGUOUS", "WRITEABLE"]))
