"""Our Llama against transformers' on the bundled SmolLM2, and paged runs against one-shot runs."""

from __future__ import annotations

import pytest
import torch

from servelm.layers.rotary import rope_inv_freq
from servelm.models.config import ModelConfig
from servelm.models.llama import build_empty_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
]

LONG_TEXT = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman who went out "
    "every morning before sunrise. One day his net came back heavy with something unexpected."
)


def reference_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


def assert_logits_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    scale = theirs.abs().max()
    assert (ours - theirs).abs().max() < 1e-4 * scale
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.model
@pytest.mark.usefixtures("cpu_ops")
def test_prefill_matches_transformers(smollm, hf_model, paged_runner):
    model, config, tokenizer = smollm
    hf, _ = hf_model
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    # All prompts in one batch: three prefills side by side in one flattened step.
    runner = paged_runner(model, config)
    logits = runner.step([(f"s{i}", ids) for i, ids in enumerate(prompts)])
    for ids, ours in zip(prompts, logits):
        assert_logits_close(ours, reference_logits(hf, ids))


@pytest.mark.model
@pytest.mark.usefixtures("cpu_ops")
def test_chunked_prefill_and_decode_match_one_shot(smollm, paged_runner):
    model, config, tokenizer = smollm
    ids = tokenizer.encode(LONG_TEXT)
    assert len(ids) > 30
    full = paged_runner(model, config).step([("a", ids)])[0]

    runner = paged_runner(model, config, seed=1)
    n = len(ids) - 4
    first = runner.step([("a", ids[:13])])[0]
    # A second sequence decodes alongside the second chunk: mixed prefill + decode batch.
    runner.step([("b", ids[:5])])
    second, other = runner.step([("a", ids[13:n])], [("b", ids[5])])
    decodes = [runner.step([], [("a", token)])[0] for token in ids[n:]]
    chunked = torch.cat([first, second, *decodes])
    torch.testing.assert_close(chunked, full, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(other[0], full[5], atol=2e-4, rtol=1e-4)


@pytest.mark.model
def test_gguf_dequantization_matches_transformers(smollm, hf_model):
    """Q8_0 embedding, Q4_1 attention/MLP weights (q/k un-permuted), F32 norms."""
    model, config, _ = smollm
    hf, _ = hf_model
    ours, theirs = model.model, hf.model
    torch.testing.assert_close(ours.embed_tokens.weight, theirs.embed_tokens.weight)
    for i in (0, config.num_hidden_layers - 1):
        attn, ref = ours.layers[i].self_attn, theirs.layers[i].self_attn
        q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
        torch.testing.assert_close(q, ref.q_proj.weight)
        torch.testing.assert_close(k, ref.k_proj.weight)
        torch.testing.assert_close(v, ref.v_proj.weight)
        gate, up = ours.layers[i].mlp.gate_up_proj.weight.chunk(2)
        torch.testing.assert_close(gate, theirs.layers[i].mlp.gate_proj.weight)
        torch.testing.assert_close(up, theirs.layers[i].mlp.up_proj.weight)
        torch.testing.assert_close(ours.layers[i].input_layernorm.weight, theirs.layers[i].input_layernorm.weight)


@pytest.mark.model
def test_bfloat16_stays_close(smollm, paged_runner):
    """Low precision runs and picks mostly the same tokens (no float32-only assumptions)."""
    model32, config, tokenizer = smollm
    model16 = build_empty_model(config, torch.bfloat16, torch.device("cpu"))
    model16.load_state_dict(model32.state_dict())
    ids = tokenizer.encode(PROMPTS[0])
    full = paged_runner(model32, config).step([("a", ids)])[0]
    low = paged_runner(model16, config).step([("a", ids)])[0]
    assert low.dtype == torch.float32
    assert (low.argmax(-1) == full.argmax(-1)).float().mean() >= 0.8


@pytest.mark.model
@pytest.mark.usefixtures("native_kernels")
def test_native_kernels_match_the_pytorch_path_in_bfloat16(smollm, paged_runner, monkeypatch):
    """The fused CPU ops round as the PyTorch code does: both paths give the same bfloat16 logits, near enough."""
    from servelm import kernels

    model32, config, tokenizer = smollm
    model16 = build_empty_model(config, torch.bfloat16, torch.device("cpu"))
    model16.load_state_dict(model32.state_dict())
    ids = tokenizer.encode(LONG_TEXT)

    def run():  # a prefill, then decodes of two sequences side by side
        runner = paged_runner(model16, config)
        logits = runner.step([("a", ids[:-3]), ("b", ids[:9])])
        for i in range(3):
            logits += runner.step([], [("a", ids[-3 + i]), ("b", ids[9 + i])])
        return torch.cat(logits)

    native = run()
    monkeypatch.setattr(kernels, "cpu_kernels", lambda: None)
    reference = run()
    assert (native.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.95
    assert (native - reference).abs().max() < 0.05 * reference.abs().max()


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(
        architecture="LlamaForCausalLM",
        vocab_size=100,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    return ModelConfig(**(fields | overrides))


def test_load_weights_rejects_missing_unknown_and_misshapen_tensors():
    model = build_empty_model(tiny_config(), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="lacks"):
        model.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(32, 32))])
    with pytest.raises(ValueError, match="no place"):
        model.load_weights([("model.layers.0.self_attn.rotary.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(32, 32))])


def test_tied_model_has_no_head_and_uses_the_embedding():
    model = build_empty_model(tiny_config(tie_word_embeddings=True), torch.float32, torch.device("cpu"))
    assert model.lm_head is None
    model.model.embed_tokens.weight.normal_()
    hidden = torch.randn(3, 32)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ model.model.embed_tokens.weight.T)


def test_llama3_rope_scaling_changes_only_low_frequencies():
    plain = rope_inv_freq(32, tiny_config().rope_theta)
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    scaled = rope_inv_freq(32, tiny_config().rope_theta, scaling)
    wavelen = 2 * torch.pi / plain
    torch.testing.assert_close(scaled[wavelen < 8], plain[wavelen < 8])
    torch.testing.assert_close(scaled[wavelen > 32], plain[wavelen > 32] / 8)
    assert (scaled < plain).any()
