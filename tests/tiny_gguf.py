"""Tiny random models written twice: as an mlx-lm safetensors directory and as the GGUF file
llama.cpp's converter (convert_hf_to_gguf.py) would write for them.

The GGUF side uses only the `gguf` package (llama.cpp's gguf-py): its writer and metadata keys,
its TensorNameMap from Hugging Face names to GGUF names, and its numpy quantizers. What the
converter does on top is repeated here from its source: llama's q/k row permutation, Gemma's
norm weights stored as 1 + w, llama3's `rope_freqs` factors.

For the K-quants, which the package cannot quantize, blocks are random bytes with sane float16
fields: every bit pattern is a valid block, and the package dequantizes it as the reference.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import GGML_QUANT_SIZES, MODEL_ARCH, GGMLQuantizationType
from mlx.utils import tree_flatten

Q = GGMLQuantizationType
# Byte offsets of the float16 fields (d, dmin, m) inside one block of each type.
HALF_FIELDS = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
    Q.IQ2_XXS: (0,),
    Q.IQ3_S: (0,),
}
GGUF_ARCH = {
    "llama": MODEL_ARCH.LLAMA,
    "mixtral": MODEL_ARCH.LLAMA,  # llama.cpp writes Mixtral as a llama with experts
    "qwen2": MODEL_ARCH.QWEN2,
    "qwen3": MODEL_ARCH.QWEN3,
    "qwen3_moe": MODEL_ARCH.QWEN3MOE,
    "phi3": MODEL_ARCH.PHI3,
    "gemma2": MODEL_ARCH.GEMMA2,
    "gemma3_text": MODEL_ARCH.GEMMA3,
}
VOCAB = 320


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random but well-formed `qtype` data for a (rows, cols) matrix: (rows, bytes per row)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for offset in HALF_FIELDS[qtype]:
        scale = rng.uniform(0.0005, 0.002, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8)
    return blocks.reshape(rows, -1)


def llama_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (q/k rows for interleaved RoPE)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llama3_rope_freqs(config: dict[str, Any]) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3."""
    scaling = config["rope_scaling"]
    base, dim = config["rope_theta"], config["head_dim"]
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(rope_factors, dtype=np.float32)


def tiny_config(model_type: str, **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    if model_type == "qwen2":
        config["num_key_value_heads"] = 2
    if model_type == "mixtral":
        config.update(num_local_experts=4, num_experts_per_tok=2, head_dim=16)
    if model_type == "qwen3_moe":
        config.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
    if model_type.startswith("gemma"):
        config.update(
            head_dim=32,
            query_pre_attn_scalar=32,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        )
    if model_type == "gemma2":
        config.update(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    if model_type == "gemma3_text":
        config.update(
            rope_theta=1_000_000.0,
            rope_local_base_freq=10000.0,
            sliding_window=512,
            sliding_window_pattern=6,
            num_hidden_layers=6,  # mlx-lm needs one global layer (every sixth)
        )
    if model_type == "phi3":
        config.update(head_dim=16, original_max_position_embeddings=1024)
    return {**config, **overrides}


def tiny_weights(config: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 parameters of the mlx-lm model for `config`, by their mlx-lm names."""
    mx.random.seed(seed)
    family = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model: nn.Module = family.Model(family.ModelArgs.from_dict(config))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            # Exact in float32 after llama.cpp's + 1 (Gemma) and our - 1.
            array = rng.integers(-16, 17, value.shape).astype(np.float32) / 64 + 1
            if config["model_type"].startswith("gemma"):
                array -= 1
        else:
            array = rng.normal(0, 0.08, value.shape).astype(np.float32)
        weights[name] = array
    return weights


def save_mlx_dir(path: Path, config: dict[str, Any], weights: dict[str, np.ndarray]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(
        str(path / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()}
    )
    return path


def gpt2_vocab() -> dict[str, Any]:
    """A byte-level BPE vocabulary of VOCAB tokens (bytes, a few merges, ChatML specials)."""
    from tokenizers import pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = [*specials, *sorted(pre_tokenizers.ByteLevel.alphabet())]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ t", "Ġt he"]
    tokens += [m.replace(" ", "") for m in merges]
    tokens += [f"<|extra_{i}|>" for i in range(VOCAB - len(tokens))]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return {"model": "gpt2", "pre": "smollm", "tokens": tokens, "types": types, "merges": merges}


def _add_metadata(writer: gguf.GGUFWriter, config: dict[str, Any], vocab: dict[str, Any]) -> None:
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    model_type = config["model_type"]
    if model_type == "phi3":
        writer.add_rope_dimension_count(config["head_dim"])
        writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
    if model_type == "mixtral":
        writer.add_expert_count(config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if model_type == "qwen3_moe":
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if model_type == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if model_type == "gemma3_text":
        writer.add_sliding_window(config["sliding_window"])
    writer.add_tokenizer_model(vocab["model"])
    if "pre" in vocab:
        writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    if "merges" in vocab:
        writer.add_token_merges(vocab["merges"])
    if "scores" in vocab:
        writer.add_token_scores(vocab["scores"])
    for key, value in vocab.get("extra", {}).items():
        getattr(writer, f"add_{key}")(value)
    writer.add_bos_token_id(vocab.get("bos", 1))
    writer.add_eos_token_id(vocab.get("eos", 2))


def write_gguf(
    path: Path,
    config: dict[str, Any],
    weights: dict[str, np.ndarray],
    qtype: GGMLQuantizationType = Q.F32,
    vocab: dict[str, Any] | None = None,
    arch_name: str | None = None,
) -> dict[str, np.ndarray]:
    """Write `weights` as llama.cpp would, matrices in `qtype`; returns the weights the file
    holds, dequantized, by mlx-lm name (what an exact import must reproduce). `arch_name`
    overrides `general.architecture` (and the metadata keys' prefix)."""
    model_type = config["model_type"]
    arch = GGUF_ARCH[model_type]
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(path, arch_name or gguf.MODEL_ARCH_NAMES[arch])
    _add_metadata(writer, config, vocab or gpt2_vocab())
    held = {}
    for name, array in weights.items():
        base, suffix = name.rsplit(".", 1)
        # mlx-lm stacks the experts as switch_mlp; llama.cpp's map knows them as mlp.experts.
        stacked = base.replace("block_sparse_moe.switch_mlp", "mlp.experts")
        gguf_name = names.get_name(stacked.replace("switch_mlp", "experts"))
        assert gguf_name is not None, name
        data = array
        if arch == MODEL_ARCH.LLAMA and gguf_name.endswith(("attn_q", "attn_k")):
            heads = config["num_attention_heads"]
            kv = heads if gguf_name.endswith("attn_q") else config["num_key_value_heads"]
            data = llama_permute(array, heads, kv)
        if model_type.startswith("gemma") and name.endswith("norm.weight"):
            data = array + 1
        if array.ndim >= 2 and qtype != Q.F32:
            # As llama-quantize: rows that do not fill its blocks fall back to Q8_0.
            kind = qtype if array.shape[-1] % GGML_QUANT_SIZES[qtype][0] == 0 else Q.Q8_0
            if kind in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16):
                raw = gguf.quants.quantize(array, kind)
            else:
                raw = random_blocks(kind, math.prod(array.shape[:-1]), array.shape[-1], len(held))
                raw = raw.reshape(*array.shape[:-1], -1)
            held[name] = gguf.quants.dequantize(raw, kind)
            if data is not array:  # permuting rows commutes with per-row quantization
                raw = llama_permute(raw, heads, kv)
            writer.add_tensor(f"{gguf_name}.{suffix}", raw, raw_dtype=kind)
        else:
            held[name] = array
            writer.add_tensor(f"{gguf_name}.{suffix}", data.astype(np.float32))
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(config))
    if scaling.get("type") == "longrope":  # Phi3MiniModel.generate_extra_tensors
        for kind in ("long", "short"):
            factors = np.array(scaling[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held
