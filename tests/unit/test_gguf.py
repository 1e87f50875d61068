"""GGUF import: tensor names, bit widths, config and tokenizer, on a tiny GGUF written here."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from tokenizers import pre_tokenizers

from mlxd.models.gguf import (
    GGUFError,
    build_tokenizer,
    convert_gguf,
    gguf_tensor_name,
    quantization_config,
    quantized_bits,
)
from mlxd.models.loader import load_llm

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
)


def tiny_metadata(architecture: str = "llama") -> dict:
    """GGUF metadata of a byte-level BPE llama: specials, the 256 byte symbols, 'hello' merges."""
    tokens = [*SPECIAL, *sorted(pre_tokenizers.ByteLevel.alphabet()), "he", "hel", "hell", "hello"]
    u32 = mx.uint32
    return {
        "general.architecture": architecture,
        f"{architecture}.embedding_length": mx.array(64, dtype=u32),
        f"{architecture}.feed_forward_length": mx.array(128, dtype=u32),
        f"{architecture}.block_count": mx.array(1, dtype=u32),
        f"{architecture}.attention.head_count": mx.array(2, dtype=u32),
        f"{architecture}.attention.head_count_kv": mx.array(1, dtype=u32),
        f"{architecture}.context_length": mx.array(256, dtype=u32),
        f"{architecture}.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        f"{architecture}.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": mx.array([3] * len(SPECIAL) + [1] * (len(tokens) - 3)),
        "tokenizer.ggml.merges": ["h e", "he l", "hel l", "hell o"],
        "tokenizer.ggml.bos_token_id": mx.array(1, dtype=u32),
        "tokenizer.ggml.eos_token_id": mx.array(2, dtype=u32),
        "tokenizer.ggml.padding_token_id": mx.array(2, dtype=u32),
        "tokenizer.chat_template": CHATML,
    }


def write_tiny_gguf(path: Path, architecture: str = "llama") -> Path:
    """A 1-layer float32 llama GGUF (random weights, tied embeddings) of about 150 KB."""
    metadata = tiny_metadata(architecture)
    vocab, hidden, ffn = len(metadata["tokenizer.ggml.tokens"]), 64, 128
    shapes = {
        "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (hidden, hidden),
        "blk.0.attn_k.weight": (hidden // 2, hidden),
        "blk.0.attn_v.weight": (hidden // 2, hidden),
        "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_gate.weight": (ffn, hidden),
        "blk.0.ffn_up.weight": (ffn, hidden),
        "blk.0.ffn_down.weight": (hidden, ffn),
    }
    weights = {name: mx.random.normal(shape) * 0.02 for name, shape in shapes.items()}
    mx.save_gguf(str(path), weights, metadata)
    return path


@pytest.mark.parametrize(
    ("gguf", "mlx"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("token_embd.scales", "model.embed_tokens.scales"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("output.biases", "lm_head.biases"),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.1.attn_k.scales", "model.layers.1.self_attn.k_proj.scales"),
        ("blk.2.attn_v.biases", "model.layers.2.self_attn.v_proj.biases"),
        ("blk.29.attn_output.weight", "model.layers.29.self_attn.o_proj.weight"),
        ("blk.3.attn_q.bias", "model.layers.3.self_attn.q_proj.bias"),
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
        ("blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight"),
        ("blk.4.ffn_gate.weight", "model.layers.4.mlp.gate_proj.weight"),
        ("blk.4.ffn_up.scales", "model.layers.4.mlp.up_proj.scales"),
        ("blk.4.ffn_down.biases", "model.layers.4.mlp.down_proj.biases"),
    ],
)
def test_gguf_tensor_name(gguf: str, mlx: str) -> None:
    assert gguf_tensor_name(gguf) == mlx


@pytest.mark.parametrize(
    "name", ["rope_freqs.weight", "blk.0.attn_qkv.weight", "blk.x.attn_q.weight", "output"]
)
def test_gguf_tensor_name_rejects_unknown(name: str) -> None:
    with pytest.raises(GGUFError, match="unsupported GGUF tensor"):
        gguf_tensor_name(name)


@pytest.mark.parametrize(
    ("packed", "groups", "bits"),
    [(72, 18, 4), (144, 18, 8), (192, 48, 4), (36, 18, 2), (36, 6, 6)],
)
def test_quantized_bits(packed: int, groups: int, bits: int) -> None:
    assert quantized_bits(packed, groups) == bits


@pytest.mark.parametrize(("packed", "groups"), [(7, 18), (18, 18), (288, 18), (0, 18)])
def test_quantized_bits_rejects_odd_widths(packed: int, groups: int) -> None:
    with pytest.raises(GGUFError):
        quantized_bits(packed, groups)


def test_quantization_config_overrides_minority_widths() -> None:
    def quantized(rows: int, packed: int, groups: int) -> dict[str, mx.array]:
        return {"weight": mx.zeros((rows, packed), mx.uint32), "scales": mx.zeros((rows, groups))}

    weights = {
        f"{module}.{kind}": array
        for module, parts in {
            "model.embed_tokens": quantized(100, 144, 18),
            "model.layers.0.self_attn.q_proj": quantized(576, 72, 18),
            "model.layers.0.mlp.down_proj": quantized(576, 192, 48),
        }.items()
        for kind, array in parts.items()
    }
    weights["model.norm.weight"] = mx.ones((576,))

    assert quantization_config(weights) == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"},
    }
    assert quantization_config({"model.norm.weight": mx.ones((4,))}) is None


def test_build_tokenizer_byte_level_bpe() -> None:
    tokenizer = build_tokenizer(tiny_metadata())
    tokens = tiny_metadata()["tokenizer.ggml.tokens"]

    hello = tokenizer.encode("hello").ids
    assert [tokens[i] for i in hello] == ["hello"]
    # smollm pre-tokenizer splits every digit; specials stay whole and survive decoding.
    assert [tokens[i] for i in tokenizer.encode("2024").ids] == ["2", "0", "2", "4"]
    text = "<|im_start|>user\nhello, wörld 42<|im_end|>"
    ids = tokenizer.encode(text).ids
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_build_tokenizer_rejects_sentencepiece() -> None:
    with pytest.raises(GGUFError, match="tokenizer model 'llama'"):
        build_tokenizer({**tiny_metadata(), "tokenizer.ggml.model": "llama"})


def test_convert_tiny_gguf(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(write_tiny_gguf(tmp_path / "tiny.gguf"), out)

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["rope_traditional"] is True
    assert config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-5
    assert (config["hidden_size"], config["num_key_value_heads"], config["head_dim"]) == (64, 1, 32)
    assert "quantization" not in config
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHATML
    assert [tokenizer_config["bos_token"], tokenizer_config["eos_token"]] == SPECIAL[1:]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2]
    weights = mx.load(str(out / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.weight" in weights
    assert "lm_head.weight" not in weights


def test_convert_rejects_other_architectures(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported"):
        convert_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", architecture="gpt2"), tmp_path)


def test_tiny_conversion_loads(tmp_path: Path) -> None:
    convert_gguf(write_tiny_gguf(tmp_path / "tiny.gguf"), tmp_path)
    loaded = load_llm(tmp_path, dtype="bfloat16", model_name="tiny")

    assert loaded.dtype == "bfloat16"
    assert loaded.config["rope_traditional"] is True
    logits = loaded.model(mx.array([loaded.tokenizer.encode("hello")]))
    assert logits.shape[-1] == loaded.config["vocab_size"]
    assert loaded.tokenizer.eos_token_ids == {2}
