"""bench/export_shape.py on tiny shapes: the GGUFs hold the folder's model, the tokenizer is SmolLM2's padded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from benchmark.bench_scripts import bench_script

export_shape = bench_script("export_shape")
Shape = export_shape.Shape

BASE_VOCAB = 49152  # SmolLM2's tokenizer
TINY = {
    # Several heads and KV heads, so a wrong Q/K row order shows; 40 padding tokens.
    "llama": Shape("llama", 2, 64, 4, 2, 16, 96, BASE_VOCAB + 40, True, 5e5, 1e-5, 4096),
    "qwen2": Shape("qwen2", 2, 64, 4, 2, 16, 96, BASE_VOCAB + 40, True, 1e6, 1e-6, 4096),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> dict[str, Path]:
    """{architecture: folder} with model-f16.gguf and model-q8_0.gguf beside each folder."""
    out = {}
    for arch, shape in TINY.items():
        root = tmp_path_factory.mktemp(arch)
        folder = root / "model"
        export_shape.write_hf_folder(shape, model_path, folder)
        for qtype in ("F16", "Q8_0"):
            export_shape.write_gguf(
                shape, f"tiny-{arch}", model_path, folder, root / f"model-{qtype.lower()}.gguf", qtype
            )
        out[arch] = folder
    return out


def test_padding_tokens_are_new_and_distinct() -> None:
    vocab = {"<|s|>": 0, "a": 1, "b": 2, "ab": 3}
    # Pairs of a, b, ab in id order, but "ab" exists; the special token is not used.
    assert export_shape.padding_tokens(vocab, 3) == ["aa", "aab", "ba"]
    assert len(set(export_shape.padding_tokens(vocab, 8))) == 8
    with pytest.raises(ValueError, match="cannot make 9"):
        export_shape.padding_tokens(vocab, 9)


@pytest.mark.parametrize("arch", sorted(TINY))
def test_f16_gguf_is_the_folders_model_as_servelm_reads_it(exported: dict[str, Path], arch: str) -> None:
    folder = exported[arch]
    assert export_shape.gguf_mismatches(TINY[arch], folder, folder.parent / "model-f16.gguf") == []


@pytest.mark.parametrize("arch", sorted(TINY))
def test_q8_0_gguf_is_the_folders_model_within_q8_0_rounding(exported: dict[str, Path], arch: str) -> None:
    # Q8_0 rounds each weight to 1/254 of its 32-block's largest magnitude (~0.1 here).
    folder = exported[arch]
    assert export_shape.gguf_mismatches(TINY[arch], folder, folder.parent / "model-q8_0.gguf", tolerance=1e-3) == []


def test_folder_config_is_the_shape(exported: dict[str, Path]) -> None:
    config = json.loads((exported["qwen2"] / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (2, 64, 2)
    assert (config["vocab_size"], config["tie_word_embeddings"]) == (BASE_VOCAB + 40, True)
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)  # SmolLM2's <|im_start|>, <|im_end|>


def test_tokenizer_encodes_as_smollm2_and_decodes_every_id(exported: dict[str, Path], model_path: Path) -> None:
    ours = AutoTokenizer.from_pretrained(exported["llama"])
    smollm2 = AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
    assert len(ours) == BASE_VOCAB + 40
    text = "The quick brown fox, 1234 times: naïve café! <|im_start|>user"
    assert ours(text).input_ids == smollm2(text).input_ids
    padding = export_shape.padding_tokens(smollm2.get_vocab(), 40)
    assert ours.convert_ids_to_tokens(list(range(BASE_VOCAB, BASE_VOCAB + 40))) == padding
    assert ours.decode([BASE_VOCAB + 39]) == smollm2.convert_tokens_to_string([padding[-1]])
    chat = ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
