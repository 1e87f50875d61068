"""A tiny random model of each family gives the same logits and greedy tokens loaded from the GGUF
llama.cpp would write for it and from the equivalent mlx-lm safetensors directory."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from mlxd.models.gguf import convert_gguf
from tests.tiny_gguf import save_mlx_dir, tiny_config, tiny_weights, write_gguf

PROMPT = [5, 77, 123, 9, 250, 31, 64, 18]


def run(path: Path, prompt: list[int], steps: int = 8) -> tuple[np.ndarray, list[int]]:
    """Logits of the prompt and `steps` greedy tokens after it."""
    model, _ = load_model(path)
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache).astype(mx.float32)
    first = np.array(logits[0])
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([tokens[-1:]]), cache=cache).astype(mx.float32)
    return first, tokens


def both(
    tmp_path: Path, config: dict, qtype: Q = Q.F32, prompt: list[int] = PROMPT
) -> tuple[tuple[np.ndarray, list[int]], tuple[np.ndarray, list[int]], dict]:
    """(reference run, GGUF run, imported config.json) for a tiny random model."""
    held = write_gguf(tmp_path / "m.gguf", config, tiny_weights(config), qtype)
    reference = save_mlx_dir(tmp_path / "reference", config, held)
    imported = tmp_path / "imported"
    imported.mkdir()
    convert_gguf(tmp_path / "m.gguf", imported)
    imported_config = json.loads((imported / "config.json").read_text())
    return run(reference, prompt), run(imported, prompt), imported_config


@pytest.mark.parametrize(
    "model_type",
    ["llama", "mixtral", "qwen2", "qwen3", "qwen3_moe", "phi3", "gemma2", "gemma3_text"],
)
def test_same_logits_and_greedy_tokens(tmp_path: Path, model_type: str) -> None:
    config = tiny_config(model_type)
    (ref_logits, ref_tokens), (logits, tokens), imported = both(tmp_path, config)
    assert imported["model_type"] == model_type
    assert tokens == ref_tokens
    np.testing.assert_allclose(logits, ref_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["phi3", "gemma2", "gemma3_text", "qwen3_moe"])
def test_config_passes_transformers_validation(tmp_path: Path, model_type: str) -> None:
    # mlx_lm.load builds the tokenizer through transformers, which type-checks config.json.
    config = tiny_config(model_type)
    write_gguf(tmp_path / "m.gguf", config, tiny_weights(config))
    convert_gguf(tmp_path / "m.gguf", tmp_path)
    _, tokenizer = load(str(tmp_path))
    assert tokenizer.encode("hello") == [262]  # the "hello" merge of the test vocabulary


def test_llama_mistral_shape_with_tied_embeddings(tmp_path: Path) -> None:
    # Mistral's GGUFs are llama architecture: GQA 4:1, untied head, SentencePiece (see the
    # tokenizer tests); here the tied-embedding, MQA corner of the same table.
    config = tiny_config("llama", num_key_value_heads=1, tie_word_embeddings=True)
    (ref_logits, ref_tokens), (logits, tokens), imported = both(tmp_path, config)
    assert imported["tie_word_embeddings"] is True
    assert tokens == ref_tokens
    np.testing.assert_allclose(logits, ref_logits, atol=1e-4, rtol=1e-4)


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "scaling",
    [LLAMA3, {**LLAMA3, "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0}],
)
def test_llama3_rope_scaling_from_rope_freqs(tmp_path: Path, scaling: dict) -> None:
    # head_dim 64 at base 500000: some rotary pairs below, inside and above the scaled band.
    config = tiny_config(
        "llama", head_dim=64, num_attention_heads=2, num_key_value_heads=1,
        rope_theta=500000.0, rope_scaling=scaling,
    )  # fmt: skip
    prompt = [int(i) for i in np.random.default_rng(1).integers(3, 300, 400)]
    (ref_logits, ref_tokens), (logits, tokens), imported = both(tmp_path, config, prompt=prompt)
    recovered = imported["rope_scaling"]
    assert recovered["rope_type"] == "llama3"
    assert recovered["factor"] == scaling["factor"]
    # The factors fix context / low and context / high, not the three numbers themselves.
    for key in ("low_freq_factor", "high_freq_factor"):
        bound = scaling["original_max_position_embeddings"] / scaling[key]
        assert recovered["original_max_position_embeddings"] / recovered[key] == pytest.approx(
            bound, rel=1e-4
        )
    assert tokens == ref_tokens
    np.testing.assert_allclose(logits, ref_logits, atol=1e-3, rtol=1e-3)
    # The scaling matters at these positions: without it the logits differ.
    unscaled = save_mlx_dir(
        tmp_path / "unscaled",
        {**config, "rope_scaling": None},
        dict(mx.load(str(tmp_path / "reference" / "model.safetensors")).items()),
    )
    assert not np.allclose(run(unscaled, prompt, steps=1)[0], ref_logits, atol=1e-3)


def test_phi3_longrope_from_rope_factors(tmp_path: Path) -> None:
    long = [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0]  # one per rotary pair (head_dim 16)
    scaling = {"type": "longrope", "long_factor": long, "short_factor": [1.0] * 8}
    config = tiny_config(
        "phi3", rope_scaling=scaling, max_position_embeddings=4096,
        original_max_position_embeddings=1024,
    )  # fmt: skip
    (ref_logits, ref_tokens), (logits, tokens), imported = both(tmp_path, config)
    assert imported["rope_scaling"] == scaling
    assert imported["original_max_position_embeddings"] == 1024
    assert tokens == ref_tokens
    np.testing.assert_allclose(logits, ref_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("model_type", "qtype"),
    [
        ("llama", Q.Q4_0),
        ("llama", Q.Q8_0),
        ("llama", Q.Q4_K),
        ("llama", Q.Q5_K),
        ("llama", Q.Q5_1),
        ("qwen3_moe", Q.Q4_K),  # 3-D expert tensors
        ("gemma3_text", Q.Q4_K),
    ],
)
def test_quantized_model_matches_its_dequantized_weights(
    tmp_path: Path, model_type: str, qtype: Q
) -> None:
    config = tiny_config(model_type, hidden_size=128, intermediate_size=256)
    if qtype in (Q.Q4_K, Q.Q5_K):  # super-blocks of 256 values per row (Q8_0 where not)
        config.update(hidden_size=256, intermediate_size=512)
        if "moe_intermediate_size" in config:
            config["moe_intermediate_size"] = 256
    (ref_logits, ref_tokens), (logits, tokens), imported = both(tmp_path, config, qtype)
    assert imported["quantization"]["bits"] == {Q.Q8_0: 8, Q.Q5_K: 5, Q.Q5_1: 5}.get(qtype, 4)
    assert tokens == ref_tokens
    # Quantized matmul against float matmul of the same values: rounding differences only.
    np.testing.assert_allclose(logits, ref_logits, atol=1e-2, rtol=1e-2)
