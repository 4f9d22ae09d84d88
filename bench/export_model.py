"""Export the bundled SmolLM2-135M-Instruct GGUF for the peer servers of the benchmark.

Writes into ``${SERVELM_BENCH_CACHE:-~/.cache/servelm-bench}/models/``:

- ``smollm2-135m-instruct-bf16/``: a Hugging Face folder (config.json,
  model.safetensors in bfloat16, tokenizer files with the chat template,
  generation_config.json) for vLLM and ``transformers serve``;
- ``smollm2-135m-instruct-f16.gguf`` and ``smollm2-135m-instruct-q8_0.gguf``
  for llama.cpp's ``llama-server``.

Every file holds the same weights: the GGUF's tensors are dequantized
(Q4_1/Q8_0 -> float32) and rounded once to bfloat16; the F16 GGUF stores those
bfloat16 values as float16 (exact: bfloat16's 8-bit mantissa fits float16's 10
bits, and these weights are far inside float16's range) and the Q8_0 GGUF
quantizes them with gguf-py's reference Q8_0 kernel. The GGUFs are written
with gguf-py from the bundled file's own metadata (tokenizer, chat template)
and its tensor layout (llama.cpp's Q/K row order), so no llama.cpp build is
needed; the HF folder undoes that Q/K permutation with servelm's GGUF loader.

EOS is not removed from the model: every server is asked to ignore it per
request (``ignore_eos``), see bench/peers/README.md.

Idempotent: an output that exists is kept (``--force`` rewrites). ``--verify``
loads the folder with transformers and checks that its greedy output matches
servelm's engine on the bundled GGUF (float32)::

    .venv/bin/python bench/export_model.py --verify
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

NAME = "smollm2-135m-instruct"
BUNDLED = "smollm2-135m-instruct"
HF_DIR = f"{NAME}-bf16"
GGUF_F16 = f"{NAME}-f16.gguf"
GGUF_Q8_0 = f"{NAME}-q8_0.gguf"

VERIFY_PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
]
VERIFY_TOKENS = 24


def default_cache() -> Path:
    return Path(os.environ.get("SERVELM_BENCH_CACHE") or Path.home() / ".cache" / "servelm-bench")


def hf_weights(gguf_path: Path):
    """(HF name, bfloat16 tensor) for every weight of the GGUF, in HF's Q/K row order."""
    import numpy as np
    import torch

    from servelm.models.config import ModelConfig
    from servelm.models.gguf_loader import dequantize, hf_name, read_gguf, unpermute_qk

    gguf = read_gguf(gguf_path)
    meta = gguf.metadata
    arch = meta["general.architecture"]
    if meta.get(f"{arch}.vocab_size") is None:
        meta[f"{arch}.vocab_size"] = gguf.tensors["token_embd.weight"].shape[0]
    config = ModelConfig.from_gguf_metadata(meta, set(gguf.tensors))
    out = {}
    for name, tensor in gguf.tensors.items():
        array = dequantize(tensor)
        if arch == "llama" and ".attn_q." in name:
            array = unpermute_qk(array, config.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            array = unpermute_qk(array, config.num_key_value_heads)
        out[hf_name(name)] = torch.from_numpy(np.require(array, np.float32, ["C_CONTIGUOUS", "WRITEABLE"])).to(
            torch.bfloat16
        )
    return config, out


def write_hf_folder(gguf_path: Path, folder: Path) -> None:
    """The bf16 HF folder, written to a temporary sibling and renamed into place."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig

    config, weights = hf_weights(gguf_path)
    if config.architecture != "LlamaForCausalLM":
        raise SystemExit(f"expected a llama GGUF, got {config.architecture}")
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings,
        # GGUF stores it as float32 (9.9999997e-06); the checkpoint's value is 1e-05.
        rms_norm_eps=float(f"{config.rms_norm_eps:.7g}"),
        rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=config.bos_token_id,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    hf_config.architectures = ["LlamaForCausalLM"]
    hf_config.dtype = torch.bfloat16
    hf_config.save_pretrained(tmp)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=eos).save_pretrained(tmp)

    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "model.safetensors").chmod(0o644)

    write_tokenizer(gguf_path, tmp, config.max_position_embeddings)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def write_tokenizer(gguf_path: Path, folder: Path, max_len: int) -> None:
    """The GGUF's tokenizer and chat template as HF tokenizer files in ``folder``."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    tok.save_pretrained(folder)
    # transformers 5 writes the template to chat_template.jinja; older readers
    # (gguf-py's SpecialVocab, older transformers in a peer's venv) look in
    # tokenizer_config.json, so it goes there too.
    # The class name any transformers 4.x/5.x loads (5.x saves its own alias,
    # TokenizersBackend), the model's real context rather than "unlimited", and
    # none of the loading arguments save_pretrained echoes back.
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    for key in ("is_local", "local_files_only"):
        tc.pop(key, None)
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["model_max_length"] = max_len
    if not tc.get("chat_template") and tok.chat_template:
        tc["chat_template"] = tok.chat_template
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")


def write_gguf(gguf_path: Path, out: Path, qtype_name: str) -> None:
    """A GGUF with the bundled file's metadata and layout and the HF folder's bf16 weights."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys, LlamaFileType
    from gguf.quants import quantize

    from servelm.models.gguf_loader import dequantize, read_gguf

    qtype = GGMLQuantizationType[qtype_name]
    file_type = {"F16": LlamaFileType.MOSTLY_F16, "Q8_0": LlamaFileType.MOSTLY_Q8_0}[qtype_name]
    reader = GGUFReader(gguf_path)
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()
    tmp = out.with_name(out.name + ".tmp")
    writer = GGUFWriter(tmp, arch)
    for field in reader.fields.values():
        # GGUF.* are virtual; the writer adds the architecture itself.
        if field.name.startswith("GGUF.") or field.name == Keys.General.ARCHITECTURE:
            continue
        if field.name == Keys.General.FILE_TYPE:
            writer.add_file_type(int(file_type))
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)

    # Weights: the bundled tensors, dequantized and rounded to bfloat16 exactly as
    # in the HF folder (same rounding of the same float32 values, in GGUF's row order).
    src = read_gguf(gguf_path)
    tensors = []
    for name, tensor in src.tensors.items():
        values = torch.from_numpy(np.require(dequantize(tensor), np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))
        values = values.to(torch.bfloat16).to(torch.float32).numpy()
        if values.ndim == 1:  # norms stay float32, as convert_hf_to_gguf writes them
            data, kind = values, GGMLQuantizationType.F32
        elif qtype == GGMLQuantizationType.F16:
            data, kind = values.astype(np.float16), qtype
        else:
            data, kind = quantize(values, qtype), qtype
        tensors.append((name, data, kind))
    for name, data, kind in tensors:
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)


def verify(gguf_path: Path, folder: Path, gguf_files: list[Path]) -> bool:
    """Greedy float32 output of transformers on the folder vs servelm's engine on the bundled GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from servelm import LLM, SamplingParams

    ok = True
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    # Ignore EOS the way servelm and vLLM do: EOS may be generated, it just does not
    # stop. (min_new_tokens would instead mask EOS and change the greedy path.)
    hf.generation_config.eos_token_id = None
    print(f"transformers loaded {folder.name}: {type(hf).__name__}, {sum(p.numel() for p in hf.parameters())} params")
    llm = LLM(BUNDLED, dtype="float32", device="cpu", kv_cache_memory=256 << 20)
    llm_bf16 = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory=256 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=VERIFY_TOKENS, ignore_eos=True)
    for prompt in VERIFY_PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=VERIFY_TOKENS,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        hf_ids = out[0, ids.shape[1] :].tolist()
        ref = llm.chat(messages, params)[0]
        same_prompt = ref.prompt_token_ids == ids[0].tolist()
        ref_ids = ref.outputs[0].token_ids
        ex_ids = llm_bf16.chat(messages, params)[0].outputs[0].token_ids
        agree = _common_prefix(hf_ids, ref_ids)
        print(f"\nprompt: {prompt!r} (same prompt tokens in both: {same_prompt})")
        print(f"  servelm, bundled Q4_1 GGUF, fp32: {tok.decode(ref_ids)!r}")
        print(f"  transformers, bf16 export, fp32:  {tok.decode(hf_ids)!r}")
        print(f"  servelm, bf16 export, fp32:       {tok.decode(ex_ids)!r}")
        print(
            f"  transformers vs servelm-on-GGUF: {agree}/{VERIFY_TOKENS} tokens agree; "
            f"transformers vs servelm-on-export: {_common_prefix(hf_ids, ex_ids)}/{VERIFY_TOKENS}"
        )
        ok &= same_prompt and hf_ids == ex_ids and agree >= VERIFY_TOKENS // 2
    try:
        for path in gguf_files:
            if path.exists():
                hf_g = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
                hf_g.generation_config.eos_token_id = None
                ids = tok.apply_chat_template(
                    [{"role": "user", "content": VERIFY_PROMPTS[0]}],
                    add_generation_prompt=True,
                    return_tensors="pt",
                    return_dict=True,
                )["input_ids"]
                with torch.no_grad():
                    g_out = hf_g.generate(
                        ids, max_new_tokens=VERIFY_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id
                    )
                print(f"\ntransformers on {path.name}, fp32: {tok.decode(g_out[0, ids.shape[1] :])!r}")
    except Exception as exc:  # transformers' GGUF reader is a bonus check, not the point
        print(f"(could not load a GGUF export with transformers: {exc})")
    return ok


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=default_cache(), help="cache root; models go to CACHE/models")
    ap.add_argument("--force", action="store_true", help="rewrite outputs that exist")
    ap.add_argument("--verify", action="store_true", help="compare transformers on the export with servelm")
    ap.add_argument("--no-q8", action="store_true", help="skip the Q8_0 GGUF")
    args = ap.parse_args()

    from servelm.models.registry import resolve_model_path

    gguf_path = resolve_model_path(BUNDLED)
    models = args.cache / "models"
    models.mkdir(parents=True, exist_ok=True)
    folder = models / HF_DIR
    outputs = [(models / GGUF_F16, "F16")] + ([] if args.no_q8 else [(models / GGUF_Q8_0, "Q8_0")])

    if args.force or not (folder / "model.safetensors").is_file():
        t0 = time.perf_counter()
        write_hf_folder(gguf_path, folder)
        print(f"wrote {folder} in {time.perf_counter() - t0:.1f}s")
    else:
        print(f"kept {folder}")
    for out, qtype in outputs:
        if args.force or not out.is_file():
            t0 = time.perf_counter()
            write_gguf(gguf_path, out, qtype)
            print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f}s")
        else:
            print(f"kept {out}")
    if args.verify and not verify(gguf_path, folder, [o for o, _ in outputs]):
        print("VERIFY FAILED", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
