"""bench/model_cost.py: FLOPs and bytes of serving a model, from its config, checked against transformers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from benchmark.bench_scripts import bench_script

model_cost = bench_script("model_cost")
export_shape = bench_script("export_shape")
ModelCost = model_cost.ModelCost

SMOLLM2_135M = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "attention_bias": False,
}


def _tiny(architecture: str, tied: bool) -> LlamaConfig | Qwen2Config:
    common = dict(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return Qwen2Config(**common) if architecture == "qwen2" else LlamaConfig(**common, head_dim=4)


@pytest.mark.parametrize("shape", sorted(export_shape.SHAPES))
def test_parameters_of_the_benchmark_shapes_match_transformers_and_the_real_models(shape: str) -> None:
    config = export_shape.hf_config(export_shape.SHAPES[shape], bos=1, eos=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    cost = ModelCost.from_hf_config(config.to_dict())
    assert cost.params == sum(p.numel() for p in model.parameters())
    # The published sizes of Qwen2.5-0.5B and Llama-3.2-1B.
    assert cost.params == {"qwen2.5-0.5b": 494_032_768, "llama-3.2-1b": 1_235_814_400}[shape]


def test_smollm2_parameters() -> None:
    cost = ModelCost.from_hf_config(SMOLLM2_135M)
    assert cost.params == 134_515_008  # SmolLM2-135M's published size
    assert cost.kv_bytes_per_token == 30 * 2 * 3 * 64 * 2


@pytest.mark.parametrize(("architecture", "tied"), [("llama", True), ("llama", False), ("qwen2", True)])
@pytest.mark.parametrize(("prompt", "output"), [(7, 1), (5, 4)])
def test_matmul_flops_match_what_torch_counts_in_generate(
    architecture: str, tied: bool, prompt: int, output: int
) -> None:
    config = _tiny(architecture, tied)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, prompt))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=output,
            min_new_tokens=output,
            do_sample=False,
            pad_token_id=0,
        )
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    matmuls = counts.get("aten.mm", 0) + counts.get("aten.addmm", 0)  # the linears; SDPA is not counted here
    cost = ModelCost.from_hf_config(config.to_dict())
    fed = prompt + output - 1
    attention = sum(cost.attention_flops(keys) for keys in range(1, fed + 1))
    assert cost.request_flops(prompt, output) - attention == matmuls


def test_attention_flops_by_hand() -> None:
    cost = ModelCost.from_hf_config(SMOLLM2_135M)
    # Per layer and key: Q.K over 9 heads of 64 is 9 * 64 multiply-adds, weights.V the same.
    assert cost.attention_flops(1) == 30 * 2 * (2 * 9 * 64)
    assert cost.attention_flops(100) == 100 * cost.attention_flops(1)


@given(
    layers=st.integers(1, 4),
    heads=st.integers(1, 4),
    kv_heads=st.integers(1, 4),
    head_dim=st.sampled_from([2, 4, 8]),
    intermediate=st.integers(1, 64),
    vocab=st.integers(1, 1000),
    prompt=st.integers(1, 300),
    output=st.integers(1, 300),
)
def test_request_flops_is_the_sum_over_its_tokens(
    layers, heads, kv_heads, head_dim, intermediate, vocab, prompt, output
) -> None:
    cost = ModelCost(layers, heads * head_dim, heads, kv_heads, head_dim, intermediate, vocab, True, False)
    fed = range(1, prompt + output)  # positions of the tokens that go through the layers
    per_token = [2 * cost.body_params + cost.attention_flops(position) for position in fed]
    assert cost.request_flops(prompt, output) == sum(per_token) + output * 2 * cost.head_params


def test_decode_step_bytes_read_every_weight_once_and_each_sequence_cache() -> None:
    cost = ModelCost.from_hf_config(export_shape.hf_config(export_shape.SHAPES["qwen2.5-0.5b"], 1, 2).to_dict())
    norms_and_biases = 24 * (2 * 896 + (14 + 2 * 2) * 64) + 896
    weights = cost.params - norms_and_biases
    assert cost.kv_bytes_per_token == 24 * 2 * 2 * 64 * 2  # 12 KiB
    assert cost.decode_step_bytes(1, 0, "bf16") == 2 * weights
    assert cost.decode_step_bytes(32, 200, "q8_0") == weights * 34 / 32 + 32 * 200 * 12288
    # servelm's int8 cache: 64 int8 values and a float32 scale a row, 68 bytes against 128
    assert cost.decode_step_bytes(32, 200, "w8a8", kv_int8=True) == weights + 32 * 200 * 24 * 2 * 2 * 68


def test_level_rates() -> None:
    cost = ModelCost.from_hf_config(SMOLLM2_135M)
    assert model_cost.flops_per_second(cost, 4, 400, 200, 2.0) == pytest.approx(4 * cost.request_flops(100, 50) / 2.0)
    assert model_cost.flops_per_second(cost, 0, 0, 0, 2.0) is None
    step = cost.decode_step_bytes(8, 100 + 25, "bf16")
    assert model_cost.decode_bytes_per_second(cost, 8, 100, 50, 0.02, "bf16") == pytest.approx(step / 0.02)
    assert model_cost.decode_bytes_per_second(cost, 8, 100, 50, 0.0, "bf16") is None
