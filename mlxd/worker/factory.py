"""Building an engine from a model's config: the same steps in a worker process or inline."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mlxd.config import DraftWeights, ModelConfig, ServerConfig
from mlxd.errors import ModelLoadError
from mlxd.models.adapters import adapter_bytes
from mlxd.models.cpu_path_timing import choose_cpu_path
from mlxd.models.estimate import estimate_model_bytes
from mlxd.models.sources import resolve_source
from mlxd.runtime.engine import Engine

if TYPE_CHECKING:
    from mlxd.worker.embedding import EmbeddingEngine
    from mlxd.worker.llm import LLMEngine


async def locate(name: str, config: ModelConfig, server: ServerConfig) -> tuple[Path, int]:
    """The model's resolved directory (converting a GGUF on first use) and the bytes it will
    hold once loaded, weights plus its KV budget. A quantized LLM on the CPU has its weights'
    path chosen here (models/cpu_path.py: timed once per CPU and shapes, then cached), as
    the bytes depend on it."""
    cache_dir = server.cache_dir
    path: Path = await asyncio.to_thread(
        resolve_source, config.source, model_name=name, cache_dir=cache_dir
    )
    kv_budget = 0 if config.kind == "embedding" else config.cache.ram  # encoders keep no KV
    # A distributed rank loads its shard as float32 (models/loader.py packs only whole models).
    packs = config.distributed is None
    choice = await asyncio.to_thread(choose_cpu_path, path, config, server)
    if choice is not None:
        need = choice.weight_bytes + kv_budget
    else:
        need = await asyncio.to_thread(
            estimate_model_bytes, path, config.dtype, kv_budget, packs=packs
        )
    draft = config.speculative.draft if config.speculative else None
    if draft is not None:  # loaded into this model's worker too
        draft_path = await asyncio.to_thread(resolve_draft, draft, cache_dir)
        need += await asyncio.to_thread(estimate_model_bytes, draft_path, draft.dtype, 0)
    if config.adapter is not None:
        need += await asyncio.to_thread(adapter_bytes, config.adapter)
    return path, need


def resolve_draft(draft: DraftWeights, cache_dir: Path) -> Path:
    """The speculative draft model's resolved directory (errors name the draft model)."""
    return resolve_source(draft.source, model_name=draft.name, cache_dir=cache_dir)


async def load_engine(
    name: str, config: ModelConfig, path: Path, server: Callable[[], ServerConfig]
) -> Engine:
    """Load the weights at `path` into the engine of the model's kind. `server` gives the live
    server settings (the SSD KV tier's root, media policy)."""
    # Imported here: each kind pulls in its own libraries (mlx-vlm only for a vlm).
    engine_class: type[LLMEngine] | type[EmbeddingEngine]
    if config.kind == "llm":
        from mlxd.worker.llm import LLMEngine as engine_class
    elif config.kind == "vlm":
        from mlxd.worker.vlm import VLMEngine as engine_class
    elif config.kind == "embedding":
        from mlxd.worker.embedding import EmbeddingEngine as engine_class
    else:
        raise ModelLoadError(f"model '{name}': kind '{config.kind}' is not supported")
    return await engine_class.load(name, config, path, server)


async def start_inline(
    name: str,
    config: ModelConfig,
    server: Callable[[], ServerConfig],
    make_room: Callable[[int], Awaitable[None]],
) -> Engine:
    """An `EngineStarter` that loads the model into the calling process (`workers: inline`)."""
    path, need = await locate(name, config, server())
    await make_room(need)
    return await load_engine(name, config, path, server)
