"""Import a GGUF file as an mlx-lm model directory, tensor by tensor.

The file is memory-mapped (models/gguf_header.py reads its header); each tensor is converted
straight into MLX's layout (models/gguf_quants.py), renamed by its architecture's table
(models/gguf_arch.py) and written into safetensors shards of about 256 MiB as it goes
(models/shard_writer.py), never the whole model as floats; the arrays written, or the matrices
packed as the load will pack them, are kept for this process's load where there is room
(models/fresh_weights.py). config.json describes the mlx-lm model of that family and
the tokenizer is rebuilt with the `tokenizers` library (models/gguf_tokenizer.py).
(transformers' own GGUF import needs torch, which mlxd does not install.)

`inspect_gguf` reads only the header, metadata and tensor infos: what `mlxd check` asks.
"""

from __future__ import annotations

import logging
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from mlxd.kernels import Packed
from mlxd.models import fresh_weights
from mlxd.models.fresh_weights import Fresh, PackLayout
from mlxd.models.gguf_arch import ARCHITECTURES, Architecture, Meta, architecture_of
from mlxd.models.gguf_errors import (
    GGUFError,
    UnsupportedArchitecture,
    UnsupportedGGUF,
    UnsupportedQuantType,
    UnsupportedTokenizer,
)
from mlxd.models.gguf_header import GGUFFile, TensorInfo
from mlxd.models.gguf_quants import (
    GROUP_SIZE,
    Converted,
    convert,
    is_supported,
)
from mlxd.models.gguf_tokenizer import (
    build_tokenizer,
    generation_config,
    token_id,
    tokenizer_config,
    tokenizer_problem,
)
from mlxd.models.groups import as_one_matrix
from mlxd.models.packability import why_not_packable
from mlxd.models.packed import pack
from mlxd.models.read_once import Passed, ReadOnce
from mlxd.models.shard_writer import ShardWriter, write_json

log = logging.getLogger(__name__)

# Part of the conversion cache key: bump it whenever the directory this writes changes.
FORMAT_VERSION = 3  # 3: Q6_K requantized by csrc/convert.cpp's rule
_REQUIRED_METADATA = ("embedding_length", "feed_forward_length", "block_count")
# The modules a conversion packs for its load (models/fresh_weights.py): a decoder layer's
# matrices and a separate head. The load packs the rest itself (a tied embedding, experts).
_PACKED_EARLY = re.compile(r"(?:^|\.)layers\.\d+\.|^lm_head$")


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The metadata of the GGUF file at `path` (no tensor data is read)."""
    return GGUFFile(path).metadata


def gguf_model_type(metadata: dict[str, Any]) -> str:
    """The mlx-lm model type a GGUF imports as (its `general.architecture` if unsupported)."""
    arch = architecture_of(metadata)
    return str(metadata.get("general.architecture")) if arch is None else arch.model_type


def _problems(reader: GGUFFile) -> list[UnsupportedGGUF]:
    """Everything about the file this importer cannot handle, as typed errors."""
    metadata = reader.metadata
    arch_name = str(metadata.get("general.architecture"))
    if (arch := architecture_of(metadata)) is None:
        return [
            UnsupportedArchitecture(
                f"GGUF architecture {arch_name!r} is not supported "
                f"(supported: {', '.join(sorted(ARCHITECTURES))})"
            )
        ]
    problems: list[UnsupportedGGUF] = []
    if missing := [
        f"{arch_name}.{k}" for k in _REQUIRED_METADATA if f"{arch_name}.{k}" not in metadata
    ]:
        problems.append(UnsupportedGGUF(f"GGUF file lacks metadata {', '.join(missing)}"))
    if problem := tokenizer_problem(metadata):
        problems.append(UnsupportedTokenizer(problem))
    bad_types = sorted(
        {t.tensor_type.name for t in reader.tensors if not is_supported(t.tensor_type)}
    )
    if bad_types:
        problems.append(
            UnsupportedQuantType(f"GGML tensor types not supported: {', '.join(bad_types)}")
        )
    unknown = [
        t.name
        for t in reader.tensors
        if arch.mlx_name(t.name) is None and not arch.is_rope_tensor(t.name)
    ]
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        problems.append(
            UnsupportedArchitecture(
                f"unsupported GGUF tensors for {arch_name}: {', '.join(unknown[:5])}{more}"
            )
        )
    return problems


def inspect_gguf(path: Path) -> list[str]:
    """What keeps the GGUF file at `path` from importing (empty when nothing does).

    Reads the header, metadata and tensor infos only (the tensor data stays on disk): an
    unreadable file, an unsupported architecture, tensor, quantization type or tokenizer, missing
    metadata. Each problem is one line naming what is unsupported.
    """
    try:
        reader = GGUFFile(path)
    except GGUFError as exc:
        return [str(exc)]
    return [str(problem) for problem in _problems(reader)]


def quantization_config(bits: dict[str, int]) -> dict[str, Any] | None:
    """config.json's `quantization`: the commonest width, other widths under their module path.

    GGUF files mix widths (Q4_K_M keeps some matrices in Q6_K), and mlx-lm rejects weights whose
    packed width disagrees with the bits it was told.
    """
    if not bits:
        return None
    default = Counter(bits.values()).most_common(1)[0][0]
    config: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default, "mode": "affine"}
    for module, width in sorted(bits.items()):
        if width != default:
            config[module] = {"group_size": GROUP_SIZE, "bits": width, "mode": "affine"}
    return config


def _unpermute(array: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation (interleaved → half-split rotary pairs)."""
    rows = array.shape[0]
    rest = array.shape[1:]
    grouped = array.reshape(heads, rows // heads // 2, 2, *rest)
    return grouped.swapaxes(1, 2).reshape(rows, *rest)


def _converted(
    reader: GGUFFile, tensor: TensorInfo, arch: Architecture, config: dict[str, Any]
) -> Converted:
    """One tensor in MLX form, with llama.cpp's conversion-time changes undone."""
    converted = convert(reader.data(tensor), tensor.tensor_type, tensor.shape)
    parts = tensor.name.split(".")
    if arch.permute_qk and parts[-2] in ("attn_q", "attn_k"):
        heads = config["num_attention_heads" if parts[-2] == "attn_q" else "num_key_value_heads"]
        converted.weight = _unpermute(converted.weight, heads)
        if converted.scales is not None and converted.biases is not None:
            converted.scales = _unpermute(converted.scales, heads)
            converted.biases = _unpermute(converted.biases, heads)
    if arch.norm_offset and parts[-2].endswith("norm") and converted.scales is None:
        converted.weight = converted.weight.astype(mx.float32) - arch.norm_offset
    return converted


def _packed(module: str, converted: Converted, layout: PackLayout | None) -> Packed | None:
    """`module`'s matrix packed as the load will pack it (models/packed.py's `pack`, of
    float32 scales and biases: the loader casts them first), or None where the load packs it
    itself, or not at all."""
    weight, scales, biases = converted.weight, converted.scales, converted.biases
    if layout is None or scales is None or biases is None or weight.ndim != 2:
        return None
    assert converted.bits is not None
    if not _PACKED_EARLY.search(module) or why_not_packable(
        weight.shape[0], GROUP_SIZE, converted.bits
    ):
        return None
    packed = pack(
        weight,
        scales.astype(mx.float32),
        biases.astype(mx.float32),
        GROUP_SIZE,
        converted.bits,
        layout.dot_for(head=module == "lm_head"),
        layout.precise,
    )
    mx.eval(packed.weight, packed.scale_bias)
    return packed


def _write_weights(
    reader: GGUFFile,
    arch: Architecture,
    config: dict[str, Any],
    out_dir: Path,
    bar: tqdm,
    passed: Passed,
) -> tuple[Fresh, dict[str, int]]:
    """Convert and write every tensor, telling `passed` of each one's bytes once converted;
    returns what the load may take (the arrays written, by name, or their matrices packed
    where `fresh_weights.packing` asks), and the bit width of each quantized module."""
    bits: dict[str, int] = {}
    requantized: dict[tuple[str, int | None], list[float]] = defaultdict(list)
    writer = ShardWriter(out_dir)
    layout = fresh_weights.pack_layout()
    packed: dict[str, Packed] = {}
    passed(0, reader.data_start)  # the header, metadata and tensor infos: read already
    try:
        for tensor in reader.tensors:
            bar.update(tensor.n_bytes)
            if arch.is_rope_tensor(tensor.name):  # read into config.json already
                passed(*reader.span(tensor))
                continue
            name = arch.mlx_name(tensor.name)
            assert name is not None  # _problems() rejected unknown tensors
            converted = _converted(reader, tensor, arch, config)
            mx.eval(converted.weight, converted.scales, converted.biases)
            reader.release(tensor)
            passed(*reader.span(tensor))
            module = name.removesuffix(".weight")
            if writer.written is None:  # no room to hold anything for the load
                layout, packed = None, {}
            early = _packed(module, converted, layout)
            if early is not None:
                packed[module] = early
                as_one_matrix(packed, module)  # a group as the load fuses it (models/groups.py)
            writer.add(name, converted.weight, hold=early is None)
            if converted.scales is not None and converted.biases is not None:
                writer.add(f"{module}.scales", converted.scales, hold=early is None)
                writer.add(f"{module}.biases", converted.biases, hold=early is None)
                assert converted.bits is not None
                bits[module] = converted.bits
            if not converted.exact:
                requantized[tensor.tensor_type.name, converted.bits].append(converted.rel_error)
                error = converted.rel_error
                log.debug("%s requantized: relative RMS error %.2e", tensor.name, error)
        writer.finish()
        # Reading a tensor mapped its neighbours too (fault-around), some passed already:
        # unmapped now, they can leave the page cache.
        reader.unmap()
        passed(0, reader.size)
    finally:
        writer.close()
        mx.clear_cache()  # the shards' buffers, which the load would keep resident
    for (qtype, width), errors in requantized.items():
        log.warning(
            "%d %s tensors requantized to %d-bit groups of %d (MLX has no exact equivalent): "
            "relative RMS error mean %.2e, max %.2e (over every value, or a tensor's first 4 MiB)",
            len(errors),
            qtype,
            width,
            GROUP_SIZE,
            float(np.mean(errors)),
            max(errors),
        )
    return Fresh(writer.written or {}, packed if writer.written is not None else {}), bits


def model_config(reader: GGUFFile, arch: Architecture) -> dict[str, Any]:
    """config.json for the mlx-lm model of the file's architecture (quantization added later)."""
    metadata = reader.metadata
    meta = Meta(metadata, metadata["general.architecture"])
    shapes = {t.name: t.shape for t in reader.tensors}
    rope = {
        t.name.removesuffix(".weight"): np.array(
            convert(reader.data(t), t.tensor_type, t.shape).weight.astype(mx.float32)
        )
        for t in reader.tensors
        if arch.is_rope_tensor(t.name)
    }
    config: dict[str, Any] = {"model_type": arch.model_type, **arch.config(meta, shapes, rope)}
    config["bos_token_id"] = token_id(metadata, "bos")
    config["eos_token_id"] = token_id(metadata, "eos")
    config["pad_token_id"] = token_id(metadata, "padding")  # else transformers' family default
    return config


def convert_gguf(gguf_path: Path, out_dir: Path, passed: Passed | None = None) -> Fresh:
    """Write config.json, safetensors weights and tokenizer files for `gguf_path` into `out_dir`;
    returns what a load may take instead of reading the files (models/fresh_weights.py): the
    weights written, by name (evaluated), or packed. `passed` is told of each range of the file
    converted (models/read_once.py); by default those leave the page cache at once.

    Raises GGUFError for unreadable files, its subclass UnsupportedGGUF (as UnsupportedArchitecture,
    UnsupportedQuantType or UnsupportedTokenizer) for files it cannot import.
    """
    reader = GGUFFile(gguf_path)
    metadata = reader.metadata
    if problems := _problems(reader):
        # The first problem's type, every problem's message.
        raise type(problems[0])(f"{gguf_path}: " + "; ".join(str(p) for p in problems))
    arch = architecture_of(metadata)
    assert arch is not None  # _problems() rejected unsupported architectures
    try:
        config = model_config(reader, arch)
        try:
            tokenizer = build_tokenizer(metadata)
        except UnsupportedGGUF:
            raise
        except Exception as exc:  # `tokenizers` raises a bare Exception for a bad vocabulary
            raise GGUFError(f"invalid tokenizer: {exc}") from exc
    except GGUFError as exc:
        raise type(exc)(f"{gguf_path}: {exc}") from exc
    tokenizer.save(str(out_dir / "tokenizer.json"))
    write_json(
        out_dir / "tokenizer_config.json",
        tokenizer_config(metadata, config.get("max_position_embeddings")),
    )
    write_json(out_dir / "generation_config.json", generation_config(metadata))
    total = sum(int(t.n_bytes) for t in reader.tensors)
    with tqdm(
        total=total, desc=f"converting {gguf_path.name}", unit="B", unit_scale=True, disable=None
    ) as bar:
        if passed is None:
            passed = ReadOnce(gguf_path, 1).reader(0)
        fresh, bits = _write_weights(reader, arch, config, out_dir, bar, passed)
    if quantization := quantization_config(bits):
        config["quantization"] = quantization
    write_json(out_dir / "config.json", config)
    return fresh
