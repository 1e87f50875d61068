"""GGUF import: config, tokenizer and weights of tiny GGUFs written here; header inspection."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from tokenizers import pre_tokenizers

from mlxd.models.gguf import (
    GGUFError,
    UnsupportedArchitecture,
    UnsupportedQuantType,
    UnsupportedTokenizer,
    convert_gguf,
    inspect_gguf,
    quantization_config,
)
from mlxd.models.gguf_header import GGUFFile
from mlxd.models.gguf_tokenizer import build_tokenizer
from mlxd.models.loader import load_llm
from tests.tiny_gguf import random_blocks, tiny_config, tiny_weights, write_gguf

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
)


def tiny_metadata() -> dict:
    """GGUF metadata of a byte-level BPE vocabulary: specials, the 256 byte symbols, 'hello'."""
    tokens = [*SPECIAL, *sorted(pre_tokenizers.ByteLevel.alphabet()), "he", "hel", "hell", "hello"]
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * len(SPECIAL) + [1] * (len(tokens) - 3),
        "tokenizer.ggml.merges": ["h e", "he l", "hel l", "hell o"],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.chat_template": CHATML,
    }


def _vocab() -> dict:
    metadata = tiny_metadata()
    return {
        "model": "gpt2",
        "pre": "smollm",
        "tokens": metadata["tokenizer.ggml.tokens"],
        "types": metadata["tokenizer.ggml.token_type"],
        "merges": metadata["tokenizer.ggml.merges"],
        "extra": {"chat_template": CHATML, "pad_token_id": 2},
    }


def write_tiny_gguf(path: Path, architecture: str = "llama") -> Path:
    """A 1-layer float32 llama GGUF with tied embeddings, as llama.cpp writes it (≈150 KB);
    another `architecture` name makes it a file of that (unsupported) architecture."""
    vocab = _vocab()
    config = tiny_config(
        "llama", num_hidden_layers=1, vocab_size=len(vocab["tokens"]), tie_word_embeddings=True
    )
    config.update(num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    write_gguf(path, config, tiny_weights(config), vocab=vocab, arch_name=architecture)
    return path


def test_quantization_config_overrides_minority_widths() -> None:
    bits = {"model.embed_tokens": 8, "model.layers.0.self_attn.q_proj": 4, "lm_head": 4}
    assert quantization_config(bits) == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"},
    }
    assert quantization_config({}) is None


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


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenizer.ggml.model": "bert"}, "tokenizer model 'bert' is not supported"),
        ({"tokenizer.ggml.pre": "chatglm-bpe"}, "pre-tokenizer 'chatglm-bpe' is not supported"),
    ],
)
def test_build_tokenizer_rejects_unknown_kinds(change: dict, message: str) -> None:
    with pytest.raises(UnsupportedTokenizer, match=message):
        build_tokenizer({**tiny_metadata(), **change})


def test_convert_tiny_gguf(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(write_tiny_gguf(tmp_path / "tiny.gguf"), out)

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama"
    # q/k rows are un-permuted at import: mlx-lm's default (half-split) rope applies.
    assert config.get("rope_traditional", False) is False
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


def test_tiny_conversion_loads(tmp_path: Path) -> None:
    convert_gguf(write_tiny_gguf(tmp_path / "tiny.gguf"), tmp_path)
    loaded = load_llm(tmp_path, dtype="bfloat16", model_name="tiny")

    assert loaded.dtype == "bfloat16"
    logits = loaded.model(mx.array([loaded.tokenizer.encode("hello")]))
    assert logits.shape[-1] == loaded.config["vocab_size"]
    assert loaded.tokenizer.eos_token_ids == {2}


def test_convert_rejects_other_architectures(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", architecture="gpt2")
    with pytest.raises(UnsupportedArchitecture, match="architecture 'gpt2' is not supported"):
        convert_gguf(path, tmp_path)
    assert inspect_gguf(path) == [
        "GGUF architecture 'gpt2' is not supported "
        "(supported: gemma2, gemma3, llama, phi3, qwen2, qwen3, qwen3moe)"
    ]


def _with_tensor_type(path: Path, name: str, qtype: gguf.GGMLQuantizationType) -> Path:
    """Relabel one tensor's type in place (its data is not read by an inspection)."""
    reader = gguf.GGUFReader(path, "r+")
    field = next(t.field for t in reader.tensors if t.name == name)
    field.parts[-2][0] = int(qtype)  # the tensor info's type, before its offset
    del reader
    return path


def test_inspect_reports_every_problem_without_reading_data(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    assert inspect_gguf(path) == []
    _with_tensor_type(path, "blk.0.ffn_up.weight", gguf.GGMLQuantizationType.Q8_1)
    problems = inspect_gguf(path)
    assert problems == ["GGML tensor types not supported: Q8_1"]
    with pytest.raises(UnsupportedQuantType, match="Q8_1"):
        convert_gguf(path, tmp_path)


def test_inspect_names_unknown_tensors_and_tokenizers(tmp_path: Path) -> None:
    vocab = {**_vocab(), "pre": "chatglm-bpe"}
    config = tiny_config("llama", num_hidden_layers=1, vocab_size=len(vocab["tokens"]))
    path = tmp_path / "odd.gguf"
    write_gguf(path, config, tiny_weights(config), vocab=vocab)
    reader = gguf.GGUFReader(path, "r+")
    # Rename a tensor in place (same length): blk.0.ffn_up → blk.0.ffn_xx.
    field = next(t.field for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    field.parts[1][:] = np.frombuffer(b"blk.0.ffn_xx.weight", np.uint8)
    del reader
    tokenizer, tensors = inspect_gguf(path)
    assert tokenizer.startswith("pre-tokenizer 'chatglm-bpe' is not supported (supported: ")
    assert tensors == "unsupported GGUF tensors for llama: blk.0.ffn_xx.weight"
    with pytest.raises(UnsupportedTokenizer, match=r"chatglm-bpe.*; unsupported GGUF tensors"):
        convert_gguf(path, tmp_path)


def test_inspect_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 10)
    [problem] = inspect_gguf(path)
    assert problem.startswith(f"cannot read GGUF file {path}")
    with pytest.raises(GGUFError, match="cannot read GGUF file"):
        convert_gguf(path, tmp_path)


def test_a_header_cut_anywhere_is_a_gguf_error(tmp_path: Path) -> None:
    config = tiny_config("llama", num_hidden_layers=1)
    path = tmp_path / "m.gguf"
    write_gguf(path, config, tiny_weights(config))
    whole = GGUFFile(path)
    assert (
        whole.metadata["tokenizer.ggml.tokens"]
        == gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].contents()
    )
    header = path.read_bytes()[: whole.data_start - whole.alignment]  # the padding's before
    cut = tmp_path / "cut.gguf"
    for end in range(5, len(header), 7):  # in the vocabulary's strings, lengths and the rest
        cut.write_bytes(header[:end])
        with pytest.raises(GGUFError, match="cannot read GGUF file"):
            GGUFFile(cut)


def test_inconsistent_vocabulary_is_a_gguf_error(tmp_path: Path) -> None:
    vocab = {**_vocab(), "merges": ["h e", "x y"]}  # "xy" is not in the vocabulary
    config = tiny_config("llama", num_hidden_layers=1, vocab_size=len(vocab["tokens"]))
    write_gguf(tmp_path / "m.gguf", config, tiny_weights(config), vocab=vocab)
    with pytest.raises(GGUFError, match=r"invalid tokenizer: .*out of vocabulary"):
        convert_gguf(tmp_path / "m.gguf", tmp_path)


def test_sharded_output_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlxd.models.shard_writer as shards

    monkeypatch.setattr(shards, "SHARD_BYTES", 20_000)
    config = tiny_config("llama", num_hidden_layers=1)
    path = tmp_path / "m.gguf"
    write_gguf(path, config, tiny_weights(config), gguf.GGMLQuantizationType.Q8_0)
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(path, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1
    assert not list(out.glob("shard-*"))
    loaded = load_llm(out, dtype="float32", model_name="tiny")
    assert loaded.model(mx.array([[1, 2, 3]])).shape == (1, 3, config["vocab_size"])


def test_random_blocks_are_well_formed() -> None:
    blocks = random_blocks(gguf.GGMLQuantizationType.Q4_K, 4, 512)
    values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K)
    assert values.shape == (4, 512) and np.isfinite(values).all()
