"""Building an engine from a model's config: the same steps in a worker process or inline."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mlxd.config import DraftWeights, ModelConfig, ServerConfig
from mlxd.errors import ModelLoadError
from mlxd.models import ollama_store
from mlxd.models.adapters import adapter_bytes
from mlxd.models.estimate import estimate_model_bytes
from mlxd.models.gguf_header import GGUFHeaderError, read_header
from mlxd.models.sizing import dir_weights_and_geometry, gguf_weights_and_geometry, model_need
from mlxd.models.source_paths import source_path
from mlxd.models.sources import resolve_source
from mlxd.runtime.engine import Engine
from mlxd.runtime.wire import MemoryNeed

if TYPE_CHECKING:
    from mlxd.worker.embedding import EmbeddingEngine
    from mlxd.worker.llm import LLMEngine


async def size_up(
    name: str, config: ModelConfig, cache_dir: Path
) -> tuple[MemoryNeed, Path | None]:
    """What the model will hold once loaded, from its files' headers only, and its resolved
    directory when resolving read no weights (None for a GGUF: `locate` converts it once the
    daemon has made room). An unsupported GGUF is refused here, before it is read."""
    return await asyncio.to_thread(_size_up, name, config, cache_dir)


def _size_up(name: str, config: ModelConfig, cache_dir: Path) -> tuple[MemoryNeed, Path | None]:
    # A distributed rank loads its shard as float32 (models/loader.py packs only whole models).
    packs = config.distributed is None
    gguf = _gguf_file(config.source, name)
    path = None
    if gguf is not None:
        try:
            header = read_header(gguf)
        except (GGUFHeaderError, OSError) as exc:
            raise ModelLoadError(f"model '{name}': {exc}") from exc
        if problems := header.problems():
            raise ModelLoadError(f"model '{name}': {gguf.name}: {'; '.join(problems)}")
        weights, geometry = gguf_weights_and_geometry(header, config.dtype, packs=packs)
    else:
        path = resolve_source(config.source, model_name=name, cache_dir=cache_dir)
        weights, geometry = dir_weights_and_geometry(path, config.dtype, packs=packs)
    extra = 0
    draft = config.speculative.draft if config.speculative else None
    if draft is not None:  # loaded into this model's worker too
        extra += estimate_model_bytes(resolve_draft(draft, cache_dir), draft.dtype, 0)
    if config.adapter is not None:
        extra += adapter_bytes(config.adapter)
    return model_need(config, weights, geometry, extra), path


def _gguf_file(source: str, name: str) -> Path | None:
    """The GGUF file `source` names (a local or pkg:// `.gguf`, an Ollama blob), else None."""
    if source.startswith("hf://"):
        return None
    path = source_path(source, model_name=name)
    if source.startswith(ollama_store.SCHEME) or (path.is_file() and path.suffix == ".gguf"):
        return path
    return None


async def locate(name: str, config: ModelConfig, cache_dir: Path) -> Path:
    """The model's resolved directory, converting a GGUF on first use."""
    return await asyncio.to_thread(
        resolve_source, config.source, model_name=name, cache_dir=cache_dir
    )


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
    make_room: Callable[[MemoryNeed], Awaitable[None]],
) -> Engine:
    """An `EngineStarter` that loads the model into the calling process (`workers: inline`)."""
    need, path = await size_up(name, config, server().cache_dir)
    await make_room(need)
    path = path or await locate(name, config, server().cache_dir)
    return await load_engine(name, config, path, server)
