"""What a model will hold resident, from its files' headers alone: the weights as they will run,
the live KV cache of `batch.max_batch_size` sequences at the full context, and the prefix
cache's RAM tier (`cache.ram`). The daemon admits that against `server.memory_budget` before a
single weight is read (a GGUF is sized from its header, before it is converted)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxd.config import ModelConfig
from mlxd.models.estimate import estimate_weight_bytes, tensors_weight_bytes
from mlxd.models.gguf_header import GGUFHeader
from mlxd.models.loader import _target_dtype
from mlxd.runtime.wire import MemoryNeed

# Bits per weight of a GGUF quant type once in MLX's affine layout (a scale and a bias per 32).
AFFINE_BITS = {
    "Q4_0": 4,
    "Q4_1": 4,
    "Q5_0": 5,
    "Q5_1": 5,
    "Q8_0": 8,
    "Q2_K": 2,
    "Q3_K": 3,
    "Q4_K": 4,
    "Q5_K": 5,
    "Q6_K": 6,
    "IQ4_NL": 4,
    "IQ4_XS": 4,
}
GGUF_GROUP = 32
# GGML float types as safetensors dtypes; any other type is counted as float16 (dequantized).
_FLOATS = {"F32": ("F32", 4), "F16": ("F16", 2), "BF16": ("BF16", 2), "F64": ("F64", 8)}


@dataclass(frozen=True)
class KVGeometry:
    """What one token's keys and values take: per layer, kv_heads × (key + value dims)."""

    layers: int
    kv_heads: int
    key_dim: int
    value_dim: int
    context: int | None  # the model's own context length

    def bytes_per_token(self, itemsize: int) -> int:
        return self.layers * self.kv_heads * (self.key_dim + self.value_dim) * itemsize


def model_need(
    config: ModelConfig,
    weights: int,
    geometry: KVGeometry | None,
    extra: int = 0,
) -> MemoryNeed:
    """The model's MemoryNeed given its weight bytes and KV geometry (None: no KV, e.g. an
    embedding model, or a config that does not say)."""
    if config.kind == "embedding":  # encoders keep no KV
        return MemoryNeed(weights, extra=extra)
    context = config.context_length or (geometry.context if geometry else None)
    kv, shape = 0, ""
    if geometry is not None and context:
        target = _target_dtype(config.dtype)
        itemsize = 4 if target == "float32" else 2  # the KV takes the compute dtype
        sequences = config.batch.max_batch_size
        kv = sequences * context * geometry.bytes_per_token(itemsize)
        dtype = "float32" if itemsize == 4 else "16-bit"
        shape = f"{sequences} sequences x {context} tokens, {dtype}"
    return MemoryNeed(weights, kv, shape, config.cache.ram, extra)


def dir_weights_and_geometry(
    model_dir: Path, dtype: str, *, packs: bool
) -> tuple[int, KVGeometry | None]:
    """A model directory's weight bytes (safetensors headers) and KV geometry (config.json)."""
    weights = estimate_weight_bytes(model_dir, dtype, packs=packs)
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return weights, None
    return weights, _config_geometry(config)


def gguf_weights_and_geometry(
    header: GGUFHeader, dtype: str, *, packs: bool
) -> tuple[int, KVGeometry | None]:
    """A GGUF's weight bytes once imported and loaded with `dtype`, and its KV geometry, from
    the header: each quantized matrix as the affine layout it converts into, the rest as
    stored, then counted by the same rules as a converted directory (estimate.py)."""
    tensors: dict[str, dict[str, Any]] = {}
    for name, kind, shape in header.tensors:
        name = name.replace("token_embd", "model.embed_tokens")  # the embedding rules apply
        bits = AFFINE_BITS.get(kind)
        rows, columns = list(shape[:-1]), shape[-1]
        if bits is not None and name.endswith(".weight") and columns % GGUF_GROUP == 0:
            module = name.removesuffix(".weight")
            packed = [*rows, columns * bits // 32]
            groups = [*rows, columns // GGUF_GROUP]
            tensors[name] = _entry("U32", packed, 4)
            tensors[f"{module}.scales"] = _entry("F16", groups, 2)
            tensors[f"{module}.biases"] = _entry("F16", groups, 2)
        else:
            safetensors_dtype, itemsize = _FLOATS.get(kind, ("F16", 2))
            tensors[name] = _entry(safetensors_dtype, list(shape), itemsize)
    weights = tensors_weight_bytes(tensors, {"group_size": GGUF_GROUP}, dtype, packs=packs)
    return weights, _gguf_geometry(header)


def _entry(dtype: str, shape: list[int], itemsize: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [0, math.prod(shape) * itemsize]}


def _gguf_geometry(header: GGUFHeader) -> KVGeometry | None:
    layers, heads = header.arch_value("block_count"), header.arch_value("attention.head_count")
    hidden = header.arch_value("embedding_length")
    if not (isinstance(layers, int) and isinstance(heads, int) and heads and hidden):
        return None
    kv_heads = header.arch_value("attention.head_count_kv", heads)
    key_dim = header.arch_value("attention.key_length") or hidden // heads
    return KVGeometry(
        layers=layers,
        # Per-layer counts (some architectures list one per layer): the largest bounds them.
        kv_heads=max(kv_heads) if isinstance(kv_heads, list) else kv_heads,
        key_dim=key_dim,
        value_dim=header.arch_value("attention.value_length") or key_dim,
        context=header.arch_value("context_length"),
    )


def _config_geometry(config: dict[str, Any]) -> KVGeometry | None:
    text = config.get("text_config") or config  # multimodal configs nest the language model
    try:
        heads = int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        layers = int(text["num_hidden_layers"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    context = text.get("max_position_embeddings")
    return KVGeometry(
        layers=layers,
        kv_heads=int(text.get("num_key_value_heads") or heads),
        key_dim=head_dim,
        value_dim=head_dim,
        context=int(context) if context else None,
    )
