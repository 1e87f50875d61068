"""Load one rank's part of a model: mlxd's loader (float32 on the CPU, as stored elsewhere)
with the split applied while the weights are still lazy, so a rank reads only its part.

tensor: mlx-lm's own `model.shard(group)` (what `sharded_load` and mlx_lm.server use).
pipeline: `mlxd.distributed.pipeline.pipeline_model` (mlx-lm's split; llama via our stage).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxd.distributed.config import ModelGeometry, split_problems
from mlxd.distributed.pipeline import pipeline_model
from mlxd.errors import ModelLoadError
from mlxd.models.loader import LoadedModel, load_llm

STRATEGIES = ("tensor", "pipeline")


def split_model(
    model: nn.Module, config: dict[str, Any], strategy: str, group: mx.distributed.Group
) -> nn.Module:
    """`model` cut for this rank of `group`. Raises ValueError when it cannot be split so."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if group.size() == 1:
        return model
    # The same checks as `mlxd check`, for sources it could not read (hf:// not yet fetched).
    problems = split_problems(ModelGeometry.from_config(config), group.size(), strategy)
    if problems:
        raise ValueError("; ".join(problems))
    if strategy == "tensor":
        model.shard(group)
        return model
    return pipeline_model(model, group)


def load_rank(
    path: Path,
    *,
    strategy: str,
    model_name: str,
    dtype: str = "auto",
    group: mx.distributed.Group | None = None,
    kv_dtype: str = "auto",
) -> LoadedModel:
    """This rank's part of the model in `path` (a resolved model dir, see
    models.sources.resolve_source), split over `group` (default: the world mlx.launch made).

    Every rank calls it with the same arguments. `nbytes` is this rank's share. Raises
    ModelLoadError naming the model and the rank.
    """
    group = group or mx.distributed.init()
    try:
        return load_llm(
            path,
            dtype=dtype,
            model_name=model_name,
            kv_dtype=kv_dtype,
            before_eval=lambda model, config: split_model(model, config, strategy, group),
        )
    except ModelLoadError as exc:
        raise type(exc)(
            f"{exc.message} [rank {group.rank()} of {group.size()}, {strategy}]"
        ) from exc
