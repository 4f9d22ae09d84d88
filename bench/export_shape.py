"""Random-weight models of real shapes, for benchmarks at sizes beyond the bundled model.

Writes into ``${SERVELM_BENCH_CACHE:-~/.cache/servelm-bench}/models/``, for a
shape NAME (``qwen2.5-0.5b`` or ``llama-3.2-1b``):

- ``NAME-random-bf16/``: a Hugging Face folder (config.json, model.safetensors
  in bfloat16, tokenizer files with the chat template, generation_config.json)
  for servelm, vLLM and ``transformers serve``;
- ``NAME-random-f16.gguf`` and ``NAME-random-q8_0.gguf`` for llama.cpp's
  ``llama-server``, with the same weights.

The model is made by transformers from a config of the real model's shape
(layers, widths, heads, vocabulary, QKV bias, tied embeddings) with its own
random initialisation (seed 0), so it costs what the real model costs per
token but says nothing sensible. Left out on purpose: Llama 3.2's RoPE
scaling (it changes frequencies, not cost) and each model's own tokenizer.

The tokenizer is the bundled SmolLM2's (49152 tokens, its ChatML template),
with the vocabulary padded to the shape's size by tokens that BPE never makes
(concatenations of two existing tokens): text encodes exactly as with
SmolLM2's, every id the model can sample decodes to text, and llama.cpp finds
as many tokens as the embedding has rows, which it requires.

The GGUFs are written with gguf-py (no llama.cpp build needed), in the layout
``convert_hf_to_gguf.py`` gives these architectures: llama's Q/K rows
interleaved for llama.cpp's RoPE, 1-D tensors in float32, no ``output``
tensor when the embeddings are tied, and the bundled GGUF's tokenizer
metadata with the padded token list.

Idempotent (``--force`` rewrites); ``--verify`` checks the GGUF's tensors as
servelm reads them against the folder's, and transformers' greedy output on
the folder against servelm's (float32)::

    .venv/bin/python bench/export_shape.py qwen2.5-0.5b --verify
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import export_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SEED = 0
VERIFY_TOKENS = 8


@dataclass(frozen=True)
class Shape:
    """The dimensions of a decoder-only transformer, as its HF config names them."""

    architecture: str  # "llama" or "qwen2" (HF model_type and GGUF architecture alike)
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int


SHAPES = {
    # Qwen/Qwen2.5-0.5B: QKV bias (implied by qwen2), tied embeddings.
    "qwen2.5-0.5b": Shape("qwen2", 24, 896, 14, 2, 64, 4864, 151936, True, 1e6, 1e-6, 32768),
    # meta-llama/Llama-3.2-1B: tied embeddings, no bias.
    "llama-3.2-1b": Shape("llama", 16, 2048, 32, 8, 64, 8192, 128256, True, 5e5, 1e-5, 131072),
}


def model_stem(name: str) -> str:
    """The file stem of a shape's exports: ``qwen2.5-0.5b`` -> ``qwen2.5-0.5b-random``."""
    return f"{name}-random"


def hf_config(shape: Shape, bos: int, eos: int):
    """The transformers config of ``shape`` (a ``Qwen2Config`` or ``LlamaConfig``)."""
    import torch
    from transformers import LlamaConfig, Qwen2Config

    # Shape's fields are named as the configs name them; head_dim only Llama's takes.
    dims = {k: v for k, v in dataclasses.asdict(shape).items() if k not in ("architecture", "head_dim")}
    common = dict(dims, hidden_act="silu", bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
    if shape.architecture == "qwen2":
        if shape.head_dim * shape.num_attention_heads != shape.hidden_size:
            raise ValueError("qwen2 derives head_dim from hidden_size / num_attention_heads")
        config = Qwen2Config(**common, use_sliding_window=False)
        config.architectures = ["Qwen2ForCausalLM"]
    elif shape.architecture == "llama":
        config = LlamaConfig(**common, head_dim=shape.head_dim, attention_bias=False, mlp_bias=False)
        config.architectures = ["LlamaForCausalLM"]
    else:
        raise ValueError(f"unknown architecture {shape.architecture!r}")
    config.dtype = torch.bfloat16
    return config


def padding_tokens(vocab: dict[str, int], count: int) -> list[str]:
    """``count`` new token strings: concatenations of two of ``vocab``'s tokens, in id order.

    BPE has no merge that makes them, so encoding is unchanged; they are made
    of byte-level characters, so each decodes to text. Special tokens (the
    ``<|...|>`` and ``<...>`` ones SmolLM2 puts first) are not used.
    """
    base = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if not tok.startswith("<")]
    seen = set(vocab)
    out: list[str] = []
    for a, b in itertools.product(base, repeat=2):
        if len(out) == count:
            break
        if (tok := a + b) not in seen:
            seen.add(tok)
            out.append(tok)
    if len(out) < count:
        raise ValueError(f"cannot make {count} padding tokens from a vocabulary of {len(vocab)}")
    return out


def write_tokenizer(bundled: Path, folder: Path, vocab_size: int, max_len: int) -> None:
    """The bundled GGUF's tokenizer files in ``folder``, the vocabulary padded to ``vocab_size``."""
    export_model.write_tokenizer(bundled, folder, max_len)
    path = folder / "tokenizer.json"
    tok = json.loads(path.read_text(encoding="utf-8"))
    vocab = tok["model"]["vocab"]
    extra = padding_tokens(vocab, vocab_size - len(vocab))
    vocab.update({t: len(vocab) + i for i, t in enumerate(extra)})
    path.write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")


def write_hf_folder(shape: Shape, bundled: Path, folder: Path) -> None:
    """The random bf16 model and its tokenizer, written to a temporary sibling and renamed into place."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from servelm.models.gguf_loader import read_gguf

    meta = read_gguf(bundled).metadata
    bos, eos = meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(hf_config(shape, bos, eos), dtype=torch.bfloat16)
    model.save_pretrained(tmp)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=eos).save_pretrained(tmp)
    write_tokenizer(bundled, tmp, shape.vocab_size, shape.max_position_embeddings)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def permute_qk(weight, num_heads: int):
    """convert_hf_to_gguf's Q/K row order for llama.cpp's RoPE (the inverse of servelm's ``unpermute_qk``)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_tensors(shape: Shape, folder: Path) -> Iterator[tuple[str, object]]:
    """(GGUF name, float32 numpy array in llama.cpp's layout) for every tensor of the folder."""
    import gguf
    from safetensors import safe_open

    arch = gguf.MODEL_ARCH.QWEN2 if shape.architecture == "qwen2" else gguf.MODEL_ARCH.LLAMA
    names = gguf.get_tensor_name_map(arch, shape.num_hidden_layers)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for hf in f:
            array = f.get_tensor(hf).float().numpy()
            if shape.architecture == "llama" and ".q_proj." in hf:
                array = permute_qk(array, shape.num_attention_heads)
            elif shape.architecture == "llama" and ".k_proj." in hf:
                array = permute_qk(array, shape.num_key_value_heads)
            name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise ValueError(f"no GGUF name for {hf}")
            yield name, array


def write_gguf(shape: Shape, name: str, bundled: Path, folder: Path, out: Path, qtype_name: str) -> None:
    """A GGUF of the folder's weights (F16 or Q8_0) with the bundled GGUF's tokenizer, padded as the folder's."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import quantize

    vocab = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    if len(tokens) != shape.vocab_size or vocab[tokens[-1]] != shape.vocab_size - 1:
        raise ValueError(f"{folder}'s tokenizer does not have ids 0..{shape.vocab_size - 1}")
    qtype = GGMLQuantizationType[qtype_name]
    tmp = out.with_name(out.name + ".tmp")
    w = GGUFWriter(tmp, shape.architecture)
    w.add_name(model_stem(name))
    w.add_context_length(shape.max_position_embeddings)
    w.add_embedding_length(shape.hidden_size)
    w.add_block_count(shape.num_hidden_layers)
    w.add_feed_forward_length(shape.intermediate_size)
    w.add_head_count(shape.num_attention_heads)
    w.add_head_count_kv(shape.num_key_value_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_norm_eps)
    w.add_vocab_size(shape.vocab_size)
    w.add_file_type(int({"F16": LlamaFileType.MOSTLY_F16, "Q8_0": LlamaFileType.MOSTLY_Q8_0}[qtype_name]))
    w.add_quantization_version(2)
    for field in GGUFReader(bundled).fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        value = field.contents()
        if field.name == "tokenizer.ggml.tokens":
            if tokens[: len(value)] != value:
                raise ValueError(f"{folder}'s tokenizer does not start with the bundled GGUF's tokens")
            value = tokens
        elif field.name == "tokenizer.ggml.token_type":
            value = value + [1] * (shape.vocab_size - len(value))  # 1: a normal token
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(field.name, value, vtype, sub_type=sub)
    for tensor_name, array in gguf_tensors(shape, folder):
        if array.ndim == 1:  # norms and biases stay float32, as convert_hf_to_gguf writes them
            w.add_tensor(tensor_name, array)
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(tensor_name, array.astype(np.float16))
        else:
            w.add_tensor(tensor_name, quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)


def gguf_mismatches(shape: Shape, folder: Path, gguf_path: Path, tolerance: float = 1e-6) -> list[str]:
    """How the GGUF, read by servelm's GGUF loader, differs from the folder: config fields and tensors beyond ``tolerance``.

    F16 holds the folder's bf16 values exactly except where float16 goes
    subnormal (below 6e-5 in magnitude), which costs 3e-8 at most.
    """
    import numpy as np
    from safetensors import safe_open

    from servelm.models.config import ModelConfig
    from servelm.models.gguf_loader import dequantize, hf_name, read_gguf, unpermute_qk

    problems = []
    hf_cfg = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    gguf = read_gguf(gguf_path)
    g_cfg = ModelConfig.from_gguf_metadata(gguf.metadata, set(gguf.tensors))
    for field in dataclasses.fields(ModelConfig):
        if field.name in ("architecture", "sliding_window"):  # named differently; unused here
            continue
        a, b = getattr(hf_cfg, field.name), getattr(g_cfg, field.name)
        if not (a == b or (isinstance(a, float) and abs(a - b) <= 1e-6 * abs(a))):
            problems.append(f"config {field.name}: folder {a!r}, GGUF {b!r}")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        for name, tensor in gguf.tensors.items():
            array = dequantize(tensor)
            if shape.architecture == "llama" and ".attn_q." in name:
                array = unpermute_qk(array, g_cfg.num_attention_heads)
            elif shape.architecture == "llama" and ".attn_k." in name:
                array = unpermute_qk(array, g_cfg.num_key_value_heads)
            names.discard(hf_name(name))
            diff = float(np.abs(array - f.get_tensor(hf_name(name)).float().numpy()).max())
            if diff > tolerance:
                problems.append(f"tensor {name}: differs by up to {diff:.2e}")
    if names - {"lm_head.weight"}:
        problems.append(f"tensors missing from the GGUF: {sorted(names)}")
    return problems


def greedy_agrees(folder: Path) -> bool:
    """transformers' and servelm's greedy tokens on the folder in float32 (one model in memory at a time)."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM

    from servelm import LLM, SamplingParams

    prompt = [1, 504, 3458, 282, 4649, 314, 2]  # any ids of SmolLM2's vocabulary
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=VERIFY_TOKENS, do_sample=False)
    theirs = out[0, len(prompt) :].tolist()
    del hf
    gc.collect()
    llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory=256 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=VERIFY_TOKENS, ignore_eos=True)
    ours = list(llm.generate([prompt], params)[0].outputs[0].token_ids)
    print(f"greedy, float32: transformers {theirs}, servelm {ours}")
    return ours == theirs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES), help="the model shape")
    ap.add_argument(
        "--cache", type=Path, default=export_model.default_cache(), help="cache root; models go to CACHE/models"
    )
    ap.add_argument("--force", action="store_true", help="rewrite outputs that exist")
    ap.add_argument("--verify", action="store_true", help="check the GGUF and servelm against the folder")
    ap.add_argument("--no-q8", action="store_true", help="skip the Q8_0 GGUF")
    args = ap.parse_args()

    from servelm.models.registry import resolve_model_path

    shape = SHAPES[args.shape]
    bundled = resolve_model_path(export_model.BUNDLED)
    models = args.cache / "models"
    models.mkdir(parents=True, exist_ok=True)
    stem = model_stem(args.shape)
    folder = models / f"{stem}-bf16"
    outputs = [(models / f"{stem}-f16.gguf", "F16")] + ([] if args.no_q8 else [(models / f"{stem}-q8_0.gguf", "Q8_0")])

    if args.force or not (folder / "model.safetensors").is_file():
        t0 = time.perf_counter()
        write_hf_folder(shape, bundled, folder)
        print(f"wrote {folder} in {time.perf_counter() - t0:.1f}s")
    else:
        print(f"kept {folder}")
    for out, qtype in outputs:
        if args.force or not out.is_file():
            t0 = time.perf_counter()
            write_gguf(shape, args.shape, bundled, folder, out, qtype)
            print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f}s")
        else:
            print(f"kept {out}")
    if args.verify:
        problems = gguf_mismatches(shape, folder, outputs[0][0])
        print("\n".join(problems) or f"{outputs[0][0].name} read by servelm: the folder's config and tensors")
        if problems or not greedy_agrees(folder):
            print("VERIFY FAILED", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
