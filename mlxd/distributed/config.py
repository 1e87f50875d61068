"""Checks of a `distributed:` block against the model it splits, for `mlxd check` and load time.

Tensor parallel (mlx-lm's `model.shard(group)`) cuts every attention projection by heads and the
MLP by intermediate columns, so the rank count must divide the attention heads, the KV heads
and the intermediate size. Pipeline parallel gives each rank a run of whole layers, so there can
be at most one rank per layer. Both facts come from the model's config.json, or from the GGUF
metadata for a `.gguf` source (read without converting the file).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxd.config import Config, DistributedConfig, ModelConfig
from mlxd.distributed.launch import is_local_host, rank0_host

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class ModelGeometry:
    """What splitting a model depends on, read from config.json or GGUF metadata."""

    model_type: str
    attention_heads: int
    kv_heads: int
    layers: int
    intermediate_size: int | None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelGeometry:
        # Multimodal configs nest the language model's settings under text_config.
        text = config.get("text_config") or config
        heads = int(text["num_attention_heads"])
        intermediate = text.get("intermediate_size")
        return cls(
            model_type=str(config.get("model_type") or text.get("model_type")),
            attention_heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            layers=int(text["num_hidden_layers"]),
            intermediate_size=int(intermediate) if intermediate else None,
        )


def rank_count(distributed: DistributedConfig) -> int:
    """How many ranks the block starts: one per `hosts` entry or per hostfile host."""
    if distributed.hosts is not None:
        return len(distributed.hosts)
    assert distributed.hostfile is not None  # the schema demands one of the two
    data = json.loads(Path(distributed.hostfile).read_text(encoding="utf-8"))
    hosts = data["hosts"] if isinstance(data, dict) else data
    if not isinstance(hosts, list) or not hosts:
        raise ValueError("the hostfile names no hosts")
    return len(hosts)


def split_problems(geometry: ModelGeometry, ranks: int, strategy: str) -> list[str]:
    """Why `geometry` cannot be split over `ranks` with `strategy`; empty when it can."""
    problems: list[str] = []
    if strategy == "tensor":
        for what, count in (
            ("attention heads", geometry.attention_heads),
            ("KV heads", geometry.kv_heads),
            ("intermediate size", geometry.intermediate_size),
        ):
            if count is not None and count % ranks:
                problems.append(
                    f"tensor parallel over {ranks} ranks needs {what} divisible by {ranks}; "
                    f"the model has {count}{_divisors_hint(geometry, ranks)}"
                )
        if not _has_tensor_parallel(geometry.model_type):
            problems.append(
                f"mlx-lm's {geometry.model_type!r} model has no tensor parallel (shard); "
                "try strategy: pipeline"
            )
    elif strategy == "pipeline":
        if ranks > geometry.layers:
            problems.append(
                f"pipeline over {ranks} ranks needs at least one layer per rank; "
                f"the model has {geometry.layers} layers"
            )
        if not _has_pipeline(geometry.model_type):
            problems.append(
                f"no pipeline parallel for model type {geometry.model_type!r} (mlxd splits the "
                "llama family; mlx-lm others); try strategy: tensor"
            )
    return problems


def _divisors_hint(geometry: ModelGeometry, ranks: int) -> str:
    counts = [geometry.attention_heads, geometry.kv_heads, geometry.intermediate_size or 0]
    fits = [n for n in range(2, max(ranks, 8) + 1) if all(c % n == 0 for c in counts)]
    return f" (rank counts that fit: {', '.join(map(str, fits))})" if fits else ""


def _model_module(model_type: str) -> Any | None:
    try:
        return importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError:
        return None


def _has_tensor_parallel(model_type: str) -> bool:
    module = _model_module(model_type)
    return module is None or hasattr(module.Model, "shard")  # unknown: let the load decide


def _has_pipeline(model_type: str) -> bool:
    from mlxd.distributed.pipeline import PIPELINED_MODEL_TYPES

    if model_type in PIPELINED_MODEL_TYPES:
        return True
    module = _model_module(model_type)
    if module is None:
        return True  # unknown here: the load reports it
    from mlx_lm.models.pipeline import PipelineMixin

    return any(
        isinstance(value, type) and issubclass(value, PipelineMixin)
        for value in vars(module).values()
    )


def read_geometry(model: ModelConfig, cache_dir: Path) -> ModelGeometry | None:
    """The model's geometry without loading (or converting) weights; None for an hf:// source
    not yet in the local Hugging Face cache (then the load checks it)."""
    source = model.source
    if source.startswith("hf://"):
        return _cached_hf_geometry(source.removeprefix("hf://"))
    from mlxd.models.source_paths import source_path

    path = source_path(source, model_name="?")
    if path.is_dir():
        return ModelGeometry.from_config(json.loads((path / "config.json").read_text()))
    return gguf_geometry(path)


def gguf_geometry(path: Path) -> ModelGeometry:
    from mlxd.models.gguf import gguf_metadata, gguf_model_type

    # The header only: no tensor data is read or converted.
    metadata = gguf_metadata(path)
    arch = metadata["general.architecture"]

    def meta(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    heads = meta("attention.head_count")
    return ModelGeometry(
        model_type=gguf_model_type(metadata),  # what mlxd's GGUF import produces (models/gguf.py)
        attention_heads=heads,
        kv_heads=meta("attention.head_count_kv", heads),
        layers=meta("block_count"),
        intermediate_size=meta("feed_forward_length"),
    )


def _cached_hf_geometry(repo: str) -> ModelGeometry | None:
    from huggingface_hub import try_to_load_from_cache

    repo_id, _, revision = repo.partition("@")
    found = try_to_load_from_cache(repo_id, "config.json", revision=revision or None)
    if not isinstance(found, str):
        return None
    return ModelGeometry.from_config(json.loads(Path(found).read_text()))


def check_distributed(config: Config) -> list[tuple[Loc, str]]:
    """`mlxd check`'s model-aware checks of every `distributed:` block (loader.ExtraCheck)."""
    problems: list[tuple[Loc, str]] = []
    for name, model in config.models.items():
        block = model.distributed
        if block is None:
            continue
        here: Loc = ("models", name, "distributed")
        try:
            ranks = rank_count(block)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problems.append(((*here, "hostfile"), f"cannot read the hostfile: {exc}"))
            continue
        try:
            first = rank0_host(block)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            problems.append(((*here, "hostfile"), f"cannot read the hostfile: {exc}"))
            continue
        if not is_local_host(first):
            problems.append(
                (
                    (*here, "hosts" if block.hosts else "hostfile"),
                    f"rank 0 runs on {first!r}, which is not this machine: rank 0 is the "
                    "model's worker and must run where mlxd runs (list this machine first)",
                )
            )
        try:
            geometry = read_geometry(model, config.server.cache_dir)
        except Exception as exc:  # a missing file, a malformed config: say it, check the rest
            problems.append(((*here,), f"cannot read the model's geometry: {exc}"))
            continue
        if geometry is None:
            continue
        for message in split_problems(geometry, ranks, block.strategy):
            problems.append(((*here, "hosts" if block.hosts else "hostfile"), message))
    return problems
