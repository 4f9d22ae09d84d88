"""Loading HF folders and GGUF files: tiny random models of every supported architecture vs transformers."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
import transformers

from servelm.models.config import ModelConfig, UnsupportedModelError
from servelm.models.gguf_loader import dequantize, load_gguf_model, read_gguf
from servelm.models.loader import ModelLoadError, load_model
from servelm.models.registry import ModelPathError

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (config class, model class, extra config)
ARCHS = {
    "qwen2 (qkv bias, tied)": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=5000.0, tie_word_embeddings=True)),
    "qwen3 (q/k norm, head_dim 32)": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "llama (llama3 rope, untied)": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False),
    ),
    "llama (attention bias, mha)": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(attention_bias=True, num_key_value_heads=4, tie_word_embeddings=True),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, tie_word_embeddings=False)),
}


def make_hf_model(name: str, seed: int = 0):
    """A tiny transformers model with every parameter random (HF zero-inits biases, one-inits norms)."""
    config_cls, model_cls, extra = ARCHS[name]
    config = getattr(transformers, config_cls)(**(TINY | extra))
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0, 0.15)
    return model


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def prompt_ids(n: int = 40, seed: int = 0) -> list[int]:
    # Longer than the llama3 case's original context (16), so the rope scaling matters.
    return torch.randint(3, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.usefixtures("cpu_ops")
def test_hf_folder_matches_transformers(arch, tmp_path, tokenizer_dir, paged_runner):
    hf = make_hf_model(arch)
    hf.save_pretrained(tmp_path)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path)
    model, config, tokenizer = load_model(str(tmp_path), torch.float32, "cpu")
    assert config.architecture == type(hf).__name__
    assert 2 in tokenizer.eos_token_ids
    ids = prompt_ids()
    runner = paged_runner(model, config)
    ours = runner.step([("a", ids[:-3])]) + [runner.step([], [("a", token)])[0] for token in ids[-3:]]
    torch.testing.assert_close(torch.cat(ours), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_sharded_safetensors(tmp_path, tokenizer_dir, paged_runner):
    hf = make_hf_model("llama (llama3 rope, untied)")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path)
    model, config, _ = load_model(str(tmp_path), torch.float32, "cpu")
    ids = prompt_ids(12)
    ours = paged_runner(model, config).step([("a", ids)])[0]
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


# --- GGUF files written here with gguf.GGUFWriter, the way llama.cpp's converter writes them ---

_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_rope_factors(rope: dict, dim: int) -> np.ndarray:
    """convert_hf_to_gguf's llama3 rope_freqs: per-frequency divisors of the plain inverse frequencies."""
    inv_freq = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old_len, factor = rope["original_max_position_embeddings"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    factors = []
    for freq in inv_freq:
        wavelen = 2 * np.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(path, hf_model, arch: str, qtype, with_vocab_size: bool = True) -> dict[str, np.ndarray]:
    """Write ``hf_model`` as a GGUF; returns the HF-named float32 weights as stored (after quantization)."""
    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    writer.add_eos_token_id(2)
    if with_vocab_size:
        writer.add_vocab_size(cfg.vocab_size)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(rope, cfg.head_dim))
    stored = {}
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module, suffix = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_GGUF_NAMES[module]}.{suffix}"
        file_w = w
        if arch == "llama" and ".attn_q." in gguf_name:
            file_w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            file_w = llama_cpp_permute(w, cfg.num_key_value_heads)
        if w.ndim == 2:
            data = gguf.quants.quantize(file_w, qtype)
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)
            w = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
        else:
            writer.add_tensor(gguf_name, file_w)
        stored[name] = w
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


GGUF_CASES = {
    "llama": ("llama (llama3 rope, untied)", "llama"),
    "llama-mha-bias": ("llama (attention bias, mha)", "llama"),
    "qwen2": ("qwen2 (qkv bias, tied)", "qwen2"),
    "qwen3": ("qwen3 (q/k norm, head_dim 32)", "qwen3"),
}


@pytest.mark.parametrize("case", GGUF_CASES)
def test_f32_gguf_matches_transformers(case, tmp_path, paged_runner):
    """Exact weights: checks the name map, q/k un-permutation, GGUF config and llama3 rope_freqs."""
    hf_name, arch = GGUF_CASES[case]
    hf = make_hf_model(hf_name)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf, arch, gguf.GGMLQuantizationType.F32, with_vocab_size=arch != "qwen3")
    model, config = load_gguf_model(path, torch.float32, torch.device("cpu"))
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert config.eos_token_ids == [2]
    ids = prompt_ids()
    ours = paged_runner(model, config).step([("a", ids)])[0]
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q5_1"])
def test_quantized_gguf_round_trip(qtype, tmp_path):
    """Loaded parameters equal what the quantizer stored (q/k permuted on disk, restored on load)."""
    qtype = gguf.GGMLQuantizationType[qtype]
    hf = make_hf_model("llama (llama3 rope, untied)")
    path = tmp_path / "tiny.gguf"
    stored = write_gguf(path, hf, "llama", qtype)
    model, _ = load_gguf_model(path, torch.float32, torch.device("cpu"))
    attn = model.model.layers[1].self_attn
    q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
    for ours, name in [
        (q, "model.layers.1.self_attn.q_proj.weight"),
        (k, "model.layers.1.self_attn.k_proj.weight"),
        (v, "model.layers.1.self_attn.v_proj.weight"),
        (model.model.layers[0].mlp.down_proj.weight, "model.layers.0.mlp.down_proj.weight"),
        (model.model.embed_tokens.weight, "model.embed_tokens.weight"),
        (model.lm_head.weight, "lm_head.weight"),
    ]:
        torch.testing.assert_close(ours, torch.from_numpy(stored[name]), atol=0, rtol=0)
    # And quantization did change the weights (else this test would not cover dequantization).
    if qtype != gguf.GGMLQuantizationType.F16:
        assert not np.array_equal(stored["lm_head.weight"], hf.lm_head.weight.detach().numpy())


@pytest.mark.parametrize("rows", [3, 12])  # 12: dequantized four rows to a call, as one long row
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_K", "Q3_K"])
def test_k_quant_bytes_dequantize_like_transformers(qtype, rows, tmp_path):
    """K-quants (dequantize-only in gguf): our reader hands the right bytes and shape to gguf's kernels."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    qtype = gguf.GGMLQuantizationType[qtype]
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    cols = 2 * block_elems
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block_elems * block_bytes), dtype=np.uint8)
    # Every byte <= 0x3B keeps any fp16 scale's exponent below 15: finite and under 1.
    raw &= 0x3B
    path = tmp_path / "k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = read_gguf(path).tensors["w.weight"]
    assert tensor.shape == (rows, cols)
    ours = torch.from_numpy(dequantize(tensor).copy())
    reference = hf_dequantize(torch.from_numpy(raw.copy()).reshape(-1), int(qtype)).reshape(rows, cols)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-4)


# --- configs and errors ---


def test_config_from_old_and_new_rope_layouts():
    base = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=10,
        hidden_size=64,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    old = ModelConfig.from_hf_dict(base | {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    new_rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    new = ModelConfig.from_hf_dict(base | {"rope_parameters": new_rope})
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.rope_scaling == new.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    plain = ModelConfig.from_hf_dict(base | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.head_dim == 16
    mistral = ModelConfig.from_hf_dict(
        base | {"architectures": ["MistralForCausalLM"], "sliding_window": 32, "max_position_embeddings": 4096}
    )
    assert mistral.max_model_len == 32
    qwen2 = ModelConfig.from_hf_dict(
        base | {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 32, "eos_token_id": [5, 7]}
    )
    assert qwen2.sliding_window is None and qwen2.attention_bias and not qwen2.attention_out_bias
    assert qwen2.eos_token_ids == [5, 7]


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_unsupported_rope_scaling_is_named():
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_hf_dict(
            dict(
                architectures=["Qwen2ForCausalLM"],
                vocab_size=10,
                hidden_size=64,
                intermediate_size=8,
                num_hidden_layers=1,
                num_attention_heads=4,
                rope_scaling={"rope_type": "yarn", "factor": 4.0},
            )
        )


def test_unsupported_gguf_architecture_is_named(tmp_path):
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="phi3"):
        load_gguf_model(path, torch.float32, torch.device("cpu"))


def test_missing_path_is_clear():
    with pytest.raises(ModelPathError, match="no-such-model"):
        load_model("/nonexistent/no-such-model", torch.float32, "cpu")


def test_folder_without_weights_is_clear(tmp_path):
    config = make_hf_model("mistral").config
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_unsupported_dtype_is_clear():
    with pytest.raises(ValueError, match="dtype"):
        load_model("smollm2-135m-instruct", torch.int8, "cpu")


def test_non_gguf_file_is_clear(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match=r"not a \.gguf"):
        load_model(str(path), torch.float32, "cpu")
