"""What a model will hold resident, from its files' headers alone: the weights as they will run,
the live KV cache of `batch.max_batch_size` sequences at the full context, and the prefix
cache's RAM tier (`cache.ram`). The daemon admits that against `server.memory_budget` before a
single weight is read (a GGUF is sized from its header, before it is converted)."""

from __future__ import annotations

import json
import math
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxd.config import TEXT_KINDS, ModelConfig
from mlxd.memory_need import MemoryNeed
from mlxd.models.estimate import Headers, estimate_weight_bytes
from mlxd.models.gguf import model_config
from mlxd.models.gguf_arch import Meta, architecture_of
from mlxd.models.gguf_header import GGUFFile
from mlxd.models.gguf_quants import GROUP_SIZE, requant_bits, scales_dtype
from mlxd.models.kernel_layers import has_kernel_attention, stores_half_kv
from mlxd.models.loader import _target_dtype

# Bits per weight of each GGUF type the importer holds exactly in MLX's affine layout (a scale
# and a bias per 32); the others it requantizes to gguf_quants.requant_bits.
EXACT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q8_0": 8}
# GGML float types as safetensors dtypes.
_FLOATS = {"F32": ("F32", 4), "F16": ("F16", 2), "BF16": ("BF16", 2)}
_ITEMSIZES = {"F32": 4, "F16": 2}


@dataclass(frozen=True)
class KVGeometry:
    """What one token's keys and values take: per layer, kv_heads × (key + value dims)."""

    layers: int
    kv_heads: int
    key_dim: int
    value_dim: int
    context: int | None  # the model's own context length
    # The model runs `KernelAttention` (kernel_layers.has_kernel_attention), which decides
    # where the KV is float16.
    kernel_attention: bool = False

    def bytes_per_token(self, itemsize: int) -> int:
        return self.layers * self.kv_heads * (self.key_dim + self.value_dim) * itemsize


def model_need(
    config: ModelConfig,
    weights: int,
    geometry: KVGeometry | None,
    extra: int = 0,
) -> MemoryNeed:
    """The model's MemoryNeed given its weight bytes and KV geometry (None: no KV, e.g. an
    embedding or speech model, or a config that does not say)."""
    if config.kind not in TEXT_KINDS:  # encoders and speech models keep no KV
        return MemoryNeed(weights, extra=extra)
    context = config.context_length or (geometry.context if geometry else None)
    kv, shape = 0, ""
    if geometry is not None and context:
        target = _target_dtype(config.dtype)
        # The KV takes the compute dtype, but for a float16 cache on the CPU kernel path.
        if config.kind == "llm" and stores_half_kv(
            geometry.kernel_attention, target, config.cache.kv_dtype
        ):
            itemsize, dtype = 2, "float16"
        else:
            itemsize = 4 if target == "float32" else 2
            dtype = "float32" if itemsize == 4 else "16-bit"
        sequences = config.batch.max_batch_size
        kv = sequences * context * geometry.bytes_per_token(itemsize)
        shape = f"{sequences} sequences x {context} tokens, {dtype}"
    return MemoryNeed(weights, kv, shape, config.cache.ram, extra)


def dir_geometry(model_dir: Path) -> KVGeometry | None:
    """A model directory's KV geometry, from its config.json (None where it does not say)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return _config_geometry(config)


def gguf_weights_and_geometry(
    gguf: GGUFFile, dtype: str, *, packs: bool
) -> tuple[int, KVGeometry | None]:
    """A GGUF's weight bytes once imported and loaded with `dtype`, and its KV geometry, from
    its header: counted by the same rules as a converted directory (estimate.py)."""
    weights = estimate_weight_bytes(gguf_headers(gguf), dtype, packs=packs)
    return weights, _gguf_geometry(gguf)


def gguf_headers(gguf: GGUFFile) -> Headers:
    """The safetensors headers the GGUF's conversion will write (models/gguf.py), from its own
    header: each tensor under its MLX name (where the architecture is known), each quantized
    matrix in the affine layout the importer gives it, the rest as stored."""
    arch = architecture_of(gguf.metadata)
    tensors: dict[str, dict[str, Any]] = {}
    for tensor in gguf.tensors:
        if arch is not None and arch.is_rope_tensor(tensor.name):
            continue  # read into config.json's rope scaling, not written
        name = (arch.mlx_name(tensor.name) if arch else None) or tensor.name
        kind = tensor.tensor_type.name
        rows, columns = list(tensor.shape[:-1]), tensor.shape[-1]
        if kind in _FLOATS:
            safetensors_dtype, itemsize = _FLOATS[kind]
            tensors[name] = _entry(safetensors_dtype, list(tensor.shape), itemsize)
            continue
        bits = EXACT_BITS.get(kind) or requant_bits(tensor.tensor_type)
        module = name.removesuffix(".weight")
        groups = [*rows, columns // GROUP_SIZE]
        scales = scales_dtype(tensor.tensor_type)
        tensors[f"{module}.weight"] = _entry("U32", [*rows, columns * bits // 32], 4)
        tensors[f"{module}.scales"] = _entry(scales, groups, _ITEMSIZES[scales])
        tensors[f"{module}.biases"] = _entry(scales, groups, _ITEMSIZES[scales])
    # What the conversion writes as config.json's num_experts_per_tok (models/gguf_arch.py).
    top_k = Meta(gguf.metadata, gguf.metadata.get("general.architecture", ""))("expert_used_count")
    return Headers(
        tensors,
        {"group_size": GROUP_SIZE},
        top_k if isinstance(top_k, int) else None,
        _gguf_config(gguf),
    )


def _gguf_config(gguf: GGUFFile) -> dict[str, Any]:
    """config.json as the GGUF's conversion will write it, once per file object (it reads the
    rope tensors); {} where it cannot be written (the conversion then says why, with the
    file's other problems)."""
    if (config := _GGUF_CONFIGS.get(gguf)) is None:
        arch = architecture_of(gguf.metadata)
        try:
            config = model_config(gguf, arch) if arch is not None else {}
        except Exception:
            config = {}
        _GGUF_CONFIGS[gguf] = config
    return config


_GGUF_CONFIGS: weakref.WeakKeyDictionary[GGUFFile, dict[str, Any]] = weakref.WeakKeyDictionary()


def _entry(dtype: str, shape: list[int], itemsize: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [0, math.prod(shape) * itemsize]}


def _gguf_geometry(gguf: GGUFFile) -> KVGeometry | None:
    metadata = gguf.metadata
    arch = metadata.get("general.architecture")

    def value(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    layers, heads = value("block_count"), value("attention.head_count")
    hidden = value("embedding_length")
    if isinstance(heads, list):  # per-layer counts (some architectures): the largest bounds
        heads = max(heads)
    if not (isinstance(layers, int) and isinstance(heads, int) and heads and hidden):
        return None
    kv_heads = value("attention.head_count_kv", heads)
    key_dim = value("attention.key_length") or hidden // heads
    return KVGeometry(
        layers=layers,
        kv_heads=max(kv_heads) if isinstance(kv_heads, list) else kv_heads,
        key_dim=key_dim,
        value_dim=value("attention.value_length") or key_dim,
        context=value("context_length"),
        kernel_attention=has_kernel_attention(_gguf_config(gguf)),
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
        kernel_attention=has_kernel_attention(config),
    )
