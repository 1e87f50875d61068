"""Estimate a model's memory from its safetensors headers, before (and without) loading it.

Only the header of each file is read: an 8-byte little-endian length, then a JSON object giving
every tensor's dtype, shape and byte range. That is exact for weights kept as stored, and enough to
compute the size of the weights after loader.load_llm dequantizes and casts them.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxd import kernels
from mlxd.errors import ModelLoadError
from mlxd.kernels import KERNEL_BITS
from mlxd.models.loader import DTYPES, _target_dtype
from mlxd.models.packability import has_own_head, why_not_packable

# Bytes per element of each target dtype of a cast (loader.FLOAT_DTYPES).
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
# The safetensors float dtypes: the only ones model.set_dtype casts.
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
# mlx-lm's default group size when the config names none.
_DEFAULT_GROUP_SIZE = 64
# The safetensors format caps the header at 100 MB; a larger length means a corrupt file.
_MAX_HEADER = 100_000_000


@dataclass(frozen=True)
class Headers:
    """What the estimates read of a model's weights, none of them loaded: each tensor's
    safetensors header entry (dtype, shape, data_offsets) by name, mlx-lm's quantization
    config, and for a mixture of experts how many experts each token is routed to (None where
    the config does not say), and mlx-lm's config (config.json's). A model directory's come
    from its files (`headers`); a GGUF's from its own header, as its conversion will write them
    (models/sizing.py)."""

    tensors: dict[str, dict[str, Any]]
    quantization: dict[str, Any]
    experts_per_token: int | None = None
    config: dict[str, Any] = field(default_factory=dict)


def headers(source: Path | Headers) -> Headers:
    """The headers of the model directory `source` (or `source` itself, already read)."""
    if isinstance(source, Headers):
        return source
    config = _config(Path(source))
    return Headers(
        _tensors(Path(source)),
        _quantization(config),
        _experts_per_token(config),
        config,
    )


def _read_header(path: Path) -> dict[str, dict[str, Any]]:
    """The tensor entries of one safetensors file's header (without "__metadata__")."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER:
                raise ValueError(f"header length {length} is implausible")
            raw = f.read(length)
            if len(raw) != length:
                raise ValueError("file is shorter than its header length")
        header = json.loads(raw)
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        for name, entry in tensors.items():
            begin, end = entry["data_offsets"]
            shape_ok = all(isinstance(d, int) and d >= 0 for d in entry["shape"])
            if not (isinstance(entry["dtype"], str) and shape_ok and 0 <= begin <= end):
                raise ValueError(f"tensor {name!r} has a malformed entry")
    except (OSError, struct.error, ValueError, TypeError, KeyError, AttributeError) as exc:
        # json.JSONDecodeError and UnicodeDecodeError are ValueErrors.
        raise ModelLoadError(
            f"cannot read safetensors header of {path}: {type(exc).__name__}: {exc}"
        ) from exc
    return tensors


def _config(model_dir: Path) -> dict[str, Any]:
    """The model dir's config.json, or {} where it has none."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except FileNotFoundError:
        return {}  # load_llm reports the missing config; the weights still have a size
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {model_dir / 'config.json'}: {exc}") from exc
    return config if isinstance(config, dict) else {}


def _quantization(config: dict[str, Any]) -> dict[str, Any]:
    """The mlx-lm quantization config, or {} when the weights are not quantized."""
    quant = config.get("quantization") or config.get("quantization_config") or {}
    return quant if isinstance(quant, dict) else {}


# A mixture of experts' top k in config.json, by family: most, then DBRX (in `ffn_config`),
# ERNIE 4.5, Hunyuan; a multimodal model's text part in `text_config`.
_TOP_K = ("num_experts_per_tok", "moe_top_k", "moe_k", "moe_topk")


def _experts_per_token(config: dict[str, Any]) -> int | None:
    """A mixture of experts' top k, or None where the config does not say."""
    parts = (config, config.get("text_config"), config.get("ffn_config"))
    for part in (p for p in parts if isinstance(p, dict)):
        for key in _TOP_K:
            if isinstance(k := part.get(key), int) and k > 0:
                return k
    return None


def _quantized_modules(
    tensors: dict[str, dict[str, Any]], quant: dict[str, Any]
) -> dict[str, tuple[int, int, int, int]]:
    """Each quantized module's (out, in, group size, bits), from its packed weight and scales."""
    modules = {}
    for name, entry in tensors.items():
        module, _, leaf = name.rpartition(".")
        scales = tensors.get(f"{module}.scales")
        if leaf != "weight" or scales is None:
            continue
        override = quant.get(module)
        group_size = (override if isinstance(override, dict) else quant).get(
            "group_size", _DEFAULT_GROUP_SIZE
        )
        # The packed weight has the dequantized shape except its last (input) dimension.
        out_dims, in_dims = math.prod(entry["shape"][:-1]), scales["shape"][-1] * group_size
        bits = entry["shape"][-1] * 32 // in_dims
        modules[module] = (out_dims, in_dims, group_size, bits)
    return modules


def _packed_bytes(
    tensors: dict[str, dict[str, Any]], modules: dict[str, tuple[int, int, int, int]]
) -> int | None:
    """Bytes once models/packed.py packs the quantized modules it takes, or None when it
    would take none.

    Packed: the stored bits, a scale and a bias per 32 inputs, other tensors float32. An
    embedding that is also the output head (no `lm_head`) is held packed only; one beside a
    head of its own stays as stored, its scales and biases float32. A module the kernels do
    not take runs float32 (out × in), except such an embedding, kept as stored.
    """
    tied = not has_own_head(name.rpartition(".")[0] for name in tensors)
    unpacked = {module for module in modules if not _packs(tensors, module, modules[module])}
    if not (kernels.available() and len(unpacked) < len(modules)):
        return None
    total = 0
    for name, entry in tensors.items():
        module, _, leaf = name.rpartition(".")
        begin, end = entry["data_offsets"]
        # As loaded before packing: float tensors in float32, packed integers as stored.
        as_loaded = (
            math.prod(entry["shape"]) * 4 if entry["dtype"] in _FLOAT_DTYPES else end - begin
        )
        if module not in modules or leaf not in ("weight", "scales", "biases"):
            total += as_loaded
            continue
        out, in_dims, group, bits = modules[module]
        if module.endswith("embed_tokens") and not tied:  # lookups only: the stored table
            total += as_loaded
        elif module in unpacked:  # float32 for BLAS
            total += out * in_dims * 4 if leaf == "weight" else 0
        elif leaf == "weight":
            # A scale and a bias per group (kernels.scale_group): float16 when stored so (a
            # GGUF's), else float32 (kernels.pack keeps float16 only where it is exact).
            halves = all(tensors[f"{module}.{n}"]["dtype"] == "F16" for n in ("scales", "biases"))
            weights = out * in_dims * KERNEL_BITS[bits] // 8  # as widened (packability.KERNEL_BITS)
            pairs = out * in_dims // kernels.scale_group(group)
            total += weights + pairs * (4 if halves else 8)
    return total


def _packs(
    tensors: dict[str, dict[str, Any]], module: str, shape: tuple[int, int, int, int]
) -> bool:
    """Whether the kernels take this quantized module (affine quantization has biases)."""
    _, _, group, bits = shape
    rows = tensors[f"{module}.weight"]["shape"][-2]  # a matrix's, or each expert's of a stack
    return f"{module}.biases" in tensors and why_not_packable(rows, group, bits) is None


def _tensors(model_dir: Path) -> dict[str, dict[str, Any]]:
    """Every tensor entry of the model dir's weight files; ModelLoadError without any."""
    # The same files mlx-lm's load_model reads.
    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise ModelLoadError(f"no model*.safetensors weight files in {model_dir}")
    tensors: dict[str, dict[str, Any]] = {}
    for file in files:
        tensors.update(_read_header(file))
    return tensors


def quantized_shapes(source: Path | Headers) -> dict[str, tuple[int, int, int, int]]:
    """Each quantized module's (out, in, group size, bits), read from the headers alone."""
    read = headers(source)
    return _quantized_modules(read.tensors, read.quantization)


def packed_weight_bytes(source: Path | Headers) -> int | None:
    """Bytes of the weights packed for the CPU kernels, None when they would not be packed."""
    read = headers(source)
    return _packed_bytes(read.tensors, _quantized_modules(read.tensors, read.quantization))


def estimate_weight_bytes(source: Path | Headers, dtype: str, *, packs: bool = True) -> int:
    """Bytes of the model's parameters once loaded with `dtype` (see loader.load_llm), from a
    model directory or its headers already read.

    `packs`: whether the loader may pack quantized weights for the CPU kernel (not for a
    distributed rank). Kept weights count as stored. A cast turns every float tensor into
    numel × itemsize of the target, and each quantized group (`x.weight` packed uint32,
    `x.scales`, `x.biases`) into the dense out × in weight it dequantizes to. Raises
    ModelLoadError for an unknown dtype, a missing dir, no weight files, or an unreadable header.
    """
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not isinstance(source, Headers) and not Path(source).is_dir():
        raise ModelLoadError(f"model directory {source} does not exist")
    read = headers(source)
    return _weight_bytes(read.tensors, read.quantization, dtype, packs=packs)


def _weight_bytes(
    tensors: dict[str, dict[str, Any]], quant: dict[str, Any], dtype: str, *, packs: bool = True
) -> int:
    """`estimate_weight_bytes` of tensors given as safetensors header entries (dtype, shape,
    data_offsets) and mlx-lm's quantization config."""
    target = _target_dtype(dtype)
    if target is None:
        return sum(end - begin for begin, end in (t["data_offsets"] for t in tensors.values()))

    itemsize = _ITEMSIZE[target]
    modules = _quantized_modules(tensors, quant)
    if packs and dtype == "auto" and (packed := _packed_bytes(tensors, modules)) is not None:
        return packed
    total = 0
    for name, entry in tensors.items():
        module, _, leaf = name.rpartition(".")
        if module in modules and leaf in ("scales", "biases"):
            continue  # counted with the packed weight, into which they dequantize
        if module in modules and leaf == "weight":
            out_dims, in_dims, _, _ = modules[module]
            total += out_dims * in_dims * itemsize
        elif entry["dtype"] in _FLOAT_DTYPES:
            total += math.prod(entry["shape"]) * itemsize
        else:
            begin, end = entry["data_offsets"]
            total += end - begin
    return total


def estimate_model_bytes(model_dir: Path, dtype: str, kv_budget: int, *, packs: bool = True) -> int:
    """Bytes the model needs resident: its weights loaded with `dtype` plus its KV cache budget."""
    return estimate_weight_bytes(model_dir, dtype, packs=packs) + kv_budget
