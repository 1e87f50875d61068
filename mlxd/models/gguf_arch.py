"""Per-architecture tables: llama.cpp's GGUF tensor names and metadata → the mlx-lm model.

Tensor names come from the `gguf` package's own constants (llama.cpp's gguf-py): a table lists
`MODEL_TENSOR` members, not strings. What llama.cpp's converter changed on the way in is undone:
it permutes q/k rows of llama-family models for interleaved RoPE (`permute_qk`), and stores Gemma's
RMSNorm weights as 1 + w (`norm_offset`); llama3's rope scaling arrives as `rope_freqs` factors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import MODEL_TENSOR, TENSOR_NAMES

from mlxd.models.gguf_errors import UnsupportedArchitecture

T = MODEL_TENSOR
Shapes = dict[str, tuple[int, ...]]  # GGUF tensor name (blk.0.attn_q.weight) → logical shape


class Meta:
    """`{arch}.key` metadata lookups with defaults; per-layer arrays collapse to one value."""

    def __init__(self, metadata: dict[str, Any], arch: str) -> None:
        self.metadata, self.arch = metadata, arch

    def __call__(self, key: str, default: Any = None) -> Any:
        value = self.metadata.get(f"{self.arch}.{key}", default)
        if isinstance(value, list):
            if len(set(value)) > 1:
                raise UnsupportedArchitecture(
                    f"per-layer {self.arch}.{key} = {value} is not supported"
                )
            value = value[0]
        if isinstance(value, float):
            # The shortest decimal of the float32 (1e-05, not 9.999999747378752e-06) reads better.
            return float(str(np.float32(value)))
        return value

    def require(self, key: str) -> Any:
        if (value := self(key)) is None:
            raise UnsupportedArchitecture(f"GGUF metadata lacks {self.arch}.{key}")
        return value


_ATTENTION = {
    T.ATTN_Q: "self_attn.q_proj",
    T.ATTN_K: "self_attn.k_proj",
    T.ATTN_V: "self_attn.v_proj",
    T.ATTN_OUT: "self_attn.o_proj",
    T.ATTN_NORM: "input_layernorm",
}
_QK_NORM = {T.ATTN_Q_NORM: "self_attn.q_norm", T.ATTN_K_NORM: "self_attn.k_norm"}
_MLP = {T.FFN_GATE: "mlp.gate_proj", T.FFN_UP: "mlp.up_proj", T.FFN_DOWN: "mlp.down_proj"}
_LLAMA_BLOCK = {**_ATTENTION, **_MLP, T.FFN_NORM: "post_attention_layernorm"}
_GEMMA_BLOCK = {
    **_ATTENTION,
    **_MLP,
    T.ATTN_POST_NORM: "post_attention_layernorm",
    T.FFN_NORM: "pre_feedforward_layernorm",
    T.FFN_POST_NORM: "post_feedforward_layernorm",
}
_MOE_BLOCK = {
    **_ATTENTION,
    **_QK_NORM,
    T.FFN_NORM: "post_attention_layernorm",
    T.FFN_GATE_INP: "mlp.gate",
    T.FFN_GATE_EXP: "mlp.switch_mlp.gate_proj",
    T.FFN_UP_EXP: "mlp.switch_mlp.up_proj",
    T.FFN_DOWN_EXP: "mlp.switch_mlp.down_proj",
}
_MIXTRAL_BLOCK = {
    **_ATTENTION,
    T.FFN_NORM: "post_attention_layernorm",
    T.FFN_GATE_INP: "block_sparse_moe.gate",
    T.FFN_GATE_EXP: "block_sparse_moe.switch_mlp.gate_proj",
    T.FFN_UP_EXP: "block_sparse_moe.switch_mlp.up_proj",
    T.FFN_DOWN_EXP: "block_sparse_moe.switch_mlp.down_proj",
}
_PHI3_BLOCK = {
    T.ATTN_QKV: "self_attn.qkv_proj",
    T.ATTN_OUT: "self_attn.o_proj",
    T.ATTN_NORM: "input_layernorm",
    T.FFN_NORM: "post_attention_layernorm",
    T.FFN_UP: "mlp.gate_up_proj",
    T.FFN_DOWN: "mlp.down_proj",
}
_GLOBAL = {T.TOKEN_EMBD: "model.embed_tokens", T.OUTPUT_NORM: "model.norm", T.OUTPUT: "lm_head"}
# Read into config.json instead of becoming weights.
_ROPE_TENSORS = (T.ROPE_FREQS, T.ROPE_FACTORS_LONG, T.ROPE_FACTORS_SHORT)


@dataclass(frozen=True)
class Architecture:
    model_type: str
    block: dict[MODEL_TENSOR, str]
    config: Callable[[Meta, Shapes, dict[str, np.ndarray]], dict[str, Any]]
    permute_qk: bool = False
    norm_offset: float = 0.0
    rope_tensors: tuple[MODEL_TENSOR, ...] = (T.ROPE_FREQS,)
    names: dict[str, str] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        names = {TENSOR_NAMES[t]: mlx for t, mlx in _GLOBAL.items()}
        names.update({TENSOR_NAMES[t]: f"model.layers.{{bid}}.{m}" for t, m in self.block.items()})
        self.names.update(names)

    def mlx_name(self, gguf_name: str) -> str | None:
        """`blk.3.attn_q.weight` → `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
        base, dot, suffix = gguf_name.rpartition(".")
        if not dot or suffix not in ("weight", "bias"):
            return None
        template = base
        bid = ""
        parts = base.split(".")
        if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
            bid = parts[1]
            template = ".".join(["blk", "{bid}", *parts[2:]])
        mlx = self.names.get(template)
        return None if mlx is None else f"{mlx.format(bid=bid)}.{suffix}"

    def is_rope_tensor(self, gguf_name: str) -> bool:
        return gguf_name.removesuffix(".weight") in {TENSOR_NAMES[t] for t in self.rope_tensors}


def _common(meta: Meta, shapes: Shapes) -> dict[str, Any]:
    heads = meta.require("attention.head_count")
    hidden = meta.require("embedding_length")
    return {
        "hidden_size": hidden,
        "intermediate_size": meta.require("feed_forward_length"),
        "num_hidden_layers": meta.require("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": meta("attention.key_length", hidden // heads),
        "max_position_embeddings": meta("context_length", 4096),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "vocab_size": shapes[f"{TENSOR_NAMES[T.TOKEN_EMBD]}.weight"][0],
        "tie_word_embeddings": f"{TENSOR_NAMES[T.OUTPUT]}.weight" not in shapes,
    }


def llama3_rope_factors(scaling: dict[str, Any], base: float, dims: int) -> np.ndarray:
    """The `rope_freqs` llama.cpp's converter writes for a llama3 `rope_scaling` (one per pair)."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi * base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    smooth = (context / wavelen - low) / (high - low)
    middle = 1 / ((1 - smooth) / factor + smooth)
    factors = np.where(
        wavelen < context / high, 1.0, np.where(wavelen > context / low, factor, middle)
    )
    return factors.astype(np.float32)


def _llama3_scaling(factors: np.ndarray, meta: Meta, dims: int) -> dict[str, Any]:
    """mlx-lm's llama3 `rope_scaling` that reproduces `rope_freqs` (checked, not assumed).

    The factors fix the scale and the two wavelength bounds (context / low, context / high) but
    not the context itself: take the metadata's, else Llama 3's 8192; try Llama 3's low/high
    (1, 4) first, else fit them to the factors between the bounds.
    """
    base = meta("rope.freq_base", 10000.0)
    scaling: dict[str, Any] = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": int(meta("rope.scaling.original_context_length", 8192)),
    }
    candidates = [scaling]
    factor, context = scaling["factor"], scaling["original_max_position_embeddings"]
    middle = (factors > 1) & (factors < factor)
    if factor > 1 and middle.sum() >= 2:
        wavelen = 2 * math.pi * base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
        smooth = (1 / factors[middle] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(context / wavelen[middle], smooth, 1)
        low = -intercept / slope
        candidates.append({**scaling, "low_freq_factor": low, "high_freq_factor": low + 1 / slope})
    for candidate in candidates:
        if np.allclose(llama3_rope_factors(candidate, base, dims), factors, rtol=1e-4):
            return candidate
    raise UnsupportedArchitecture("rope_freqs.weight does not match llama3 rope scaling")


def _rope_scaling(meta: Meta, rope: dict[str, np.ndarray], dims: int) -> dict[str, Any] | None:
    if (factors := rope.get(TENSOR_NAMES[T.ROPE_FREQS])) is not None:
        return _llama3_scaling(factors, meta, dims)
    kind = meta("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": meta.require("rope.scaling.factor")}
    if kind == "yarn":
        return {
            "rope_type": "yarn",
            "factor": meta.require("rope.scaling.factor"),
            "original_max_position_embeddings": meta.require(
                "rope.scaling.original_context_length"
            ),
        }
    raise UnsupportedArchitecture(f"rope scaling {kind!r} is not supported")


def _llama(meta: Meta, shapes: Shapes, rope: dict[str, np.ndarray]) -> dict[str, Any]:
    config = _common(meta, shapes)
    rotary = meta("rope.dimension_count", config["head_dim"])
    if rotary != config["head_dim"]:
        raise UnsupportedArchitecture(f"partial rotary ({rotary} of {config['head_dim']})")
    config["attention_bias"] = "blk.0.attn_q.bias" in shapes
    config["rope_scaling"] = _rope_scaling(meta, rope, config["head_dim"])
    return config


def _mixtral(meta: Meta, shapes: Shapes, rope: dict[str, np.ndarray]) -> dict[str, Any]:
    config = _llama(meta, shapes, rope)
    if config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]:
        raise UnsupportedArchitecture("mixtral with head_dim × heads ≠ hidden size")
    config.update(
        num_local_experts=meta.require("expert_count"),
        num_experts_per_tok=meta.require("expert_used_count"),
    )
    return config


def _qwen2(meta: Meta, shapes: Shapes, rope: dict[str, np.ndarray]) -> dict[str, Any]:
    config = _common(meta, shapes)
    if config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]:
        raise UnsupportedArchitecture("qwen2 with head_dim × heads ≠ hidden size")
    config["rope_scaling"] = _rope_scaling(meta, rope, config["head_dim"])
    return config


def _qwen3moe(meta: Meta, shapes: Shapes, rope: dict[str, np.ndarray]) -> dict[str, Any]:
    config = _qwen2_like(meta, shapes, rope)
    config.update(
        num_experts=meta.require("expert_count"),
        num_experts_per_tok=meta.require("expert_used_count"),
        moe_intermediate_size=meta.require("expert_feed_forward_length"),
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=bool(meta("expert_weights_norm", True)),
    )
    return config


def _qwen2_like(meta: Meta, shapes: Shapes, rope: dict[str, np.ndarray]) -> dict[str, Any]:
    config = _common(meta, shapes)
    config["rope_scaling"] = _rope_scaling(meta, rope, config["head_dim"])
    return config


def _phi3(meta: Meta, shapes: Shapes, rope: dict[str, np.ndarray]) -> dict[str, Any]:
    config = _common(meta, shapes)
    config["partial_rotary_factor"] = (
        meta("rope.dimension_count", config["head_dim"]) / config["head_dim"]
    )
    original = meta("rope.scaling.original_context_length", config["max_position_embeddings"])
    config["original_max_position_embeddings"] = original
    long, short = (rope.get(TENSOR_NAMES[t]) for t in (T.ROPE_FACTORS_LONG, T.ROPE_FACTORS_SHORT))
    if long is not None and short is not None:
        config["rope_scaling"] = {
            "type": "longrope",
            "long_factor": long.tolist(),
            "short_factor": short.tolist(),
        }
    return config


def _query_scalar(meta: Meta, config: dict[str, Any], big_layers: int) -> int:
    # llama.cpp scales queries by hidden / heads for the 27B models, by head_dim otherwise.
    # An int: transformers validates Gemma's config.json types strictly.
    if config["num_hidden_layers"] == big_layers:
        return int(config["hidden_size"] // config["num_attention_heads"])
    return int(config["head_dim"])


def _gemma2(meta: Meta, shapes: Shapes, rope: dict[str, np.ndarray]) -> dict[str, Any]:
    config = _common(meta, shapes)
    config.update(
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", 1e-6),
        attn_logit_softcapping=meta("attn_logit_softcapping", 50.0),
        final_logit_softcapping=meta("final_logit_softcapping", 30.0),
        query_pre_attn_scalar=_query_scalar(meta, config, big_layers=46),
    )
    return config


def _gemma3(meta: Meta, shapes: Shapes, rope: dict[str, np.ndarray]) -> dict[str, Any]:
    config = _common(meta, shapes)
    config.update(
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", 1e-6),
        rope_local_base_freq=10000.0,  # llama.cpp's fixed value for the sliding layers
        sliding_window=meta("attention.sliding_window", 512),
        sliding_window_pattern=6,  # llama.cpp's fixed pattern: every sixth layer is global
        query_pre_attn_scalar=_query_scalar(meta, config, big_layers=62),
        rope_scaling=_rope_scaling(meta, rope, config["head_dim"]),
    )
    return config


# llama.cpp writes Mixtral as a llama with experts (`llama.expert_count`).
MIXTRAL = Architecture("mixtral", _MIXTRAL_BLOCK, _mixtral, permute_qk=True)
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", _LLAMA_BLOCK, _llama, permute_qk=True),
    "qwen2": Architecture("qwen2", _LLAMA_BLOCK, _qwen2),
    "qwen3": Architecture("qwen3", {**_LLAMA_BLOCK, **_QK_NORM}, _qwen2_like),
    "qwen3moe": Architecture("qwen3_moe", _MOE_BLOCK, _qwen3moe),
    "phi3": Architecture(
        "phi3", _PHI3_BLOCK, _phi3, rope_tensors=(T.ROPE_FACTORS_LONG, T.ROPE_FACTORS_SHORT)
    ),
    "gemma2": Architecture("gemma2", _GEMMA_BLOCK, _gemma2, norm_offset=1.0),
    "gemma3": Architecture("gemma3_text", {**_GEMMA_BLOCK, **_QK_NORM}, _gemma3, norm_offset=1.0),
}


def architecture_of(metadata: dict[str, Any]) -> Architecture | None:
    """The table for a GGUF's `general.architecture` (and expert count), None if unsupported."""
    name = metadata.get("general.architecture")
    if name == "llama" and metadata.get("llama.expert_count"):
        return MIXTRAL
    return ARCHITECTURES.get(str(name))
