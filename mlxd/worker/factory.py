"""Building an engine from a model's config: the same steps in a worker process or inline."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mlxd import ollama_store
from mlxd.config import DraftWeights, ModelConfig, ServerConfig
from mlxd.errors import ModelLoadError
from mlxd.memory_need import MemoryNeed
from mlxd.models import fresh_weights
from mlxd.models.adapters import adapter_bytes
from mlxd.models.cpu_path_timing import choose_cpu_path
from mlxd.models.estimate import estimate_model_bytes, estimate_weight_bytes
from mlxd.models.fresh_weights import PackLayout
from mlxd.models.gguf_errors import GGUFError
from mlxd.models.gguf_header import GGUFFile
from mlxd.models.sizing import dir_geometry, gguf_headers, gguf_weights_and_geometry, model_need
from mlxd.models.source_paths import source_path
from mlxd.models.sources import resolve_source
from mlxd.runtime.engine import Engine

if TYPE_CHECKING:
    from mlxd.worker.embedding import EmbeddingEngine
    from mlxd.worker.llm import LLMEngine
    from mlxd.worker.stt import STTEngine
    from mlxd.worker.tts import TTSEngine


async def locate(name: str, config: ModelConfig, server: ServerConfig) -> tuple[Path, MemoryNeed]:
    """The model's resolved directory (converting a GGUF on first use) and what it will hold
    once loaded (a MemoryNeed: weights, KV at full batch and context, prefix cache). A GGUF is
    first sized from its header: one that cannot fit server.memory_budget even alone is refused
    before it is converted (read). A quantized LLM on the CPU has its weights' path chosen here
    (models/cpu_path.py: timed once per CPU and shapes, then cached), as the bytes depend on it."""
    header = await asyncio.to_thread(_refuse_a_gguf_that_cannot_fit, name, config, server)
    layout = await asyncio.to_thread(_conversion_layout, header, config, server)
    cache_dir = server.cache_dir
    with fresh_weights.packing(layout):
        path: Path = await asyncio.to_thread(
            resolve_source, config.source, model_name=name, cache_dir=cache_dir
        )
    # A distributed rank loads its shard as float32 (models/loader.py packs only whole models).
    packs = config.distributed is None
    choice = await asyncio.to_thread(choose_cpu_path, path, config, server)
    if choice is not None:
        weights = choice.weight_bytes
    else:
        weights = await asyncio.to_thread(estimate_weight_bytes, path, config.dtype, packs=packs)
    extra = 0
    draft = config.speculative.draft if config.speculative else None
    if draft is not None:  # loaded into this model's worker too
        draft_path = await asyncio.to_thread(resolve_draft, draft, cache_dir)
        extra += await asyncio.to_thread(estimate_model_bytes, draft_path, draft.dtype, 0)
    if config.adapter is not None:
        extra += await asyncio.to_thread(adapter_bytes, config.adapter)
    geometry = await asyncio.to_thread(dir_geometry, path)  # builds an mlx-lm model: not here
    return path, model_need(config, weights, geometry, extra)


def _refuse_a_gguf_that_cannot_fit(
    name: str, config: ModelConfig, server: ServerConfig
) -> GGUFFile | None:
    """The header of the GGUF file `config.source` names (None: it names none); ModelLoadError
    where the model cannot fit server.memory_budget even alone."""
    gguf = _gguf_file(config.source, name)
    if gguf is None:
        return None
    try:
        header = GGUFFile(gguf)
    except GGUFError as exc:
        raise ModelLoadError(f"model '{name}': {exc}") from exc
    weights, geometry = gguf_weights_and_geometry(
        header, config.dtype, packs=config.distributed is None
    )
    if refusal := model_need(config, weights, geometry).over_budget(name, server):
        raise ModelLoadError(refusal)
    return header


def _conversion_layout(
    header: GGUFFile | None, config: ModelConfig, server: ServerConfig
) -> PackLayout | None:
    """How a GGUF's conversion packs its matrices for this load (models/fresh_weights.py): as
    the CPU path chosen from its header packs them, where it packs them all. None: not a GGUF,
    an adapter (its layers wrap the matrices), a plan that keeps float32 weights."""
    if header is None or config.adapter is not None:
        return None
    choice = choose_cpu_path(gguf_headers(header), config, server)
    if choice is None or choice.plan != "packed":
        return None
    return PackLayout(choice.dot, choice.precise, choice.head_dot)


def _gguf_file(source: str, name: str) -> Path | None:
    """The GGUF file `source` names (a local or pkg:// `.gguf`, an Ollama blob), else None."""
    if source.startswith("hf://"):
        return None
    path = source_path(source, model_name=name)
    if source.startswith(ollama_store.SCHEME) or (path.is_file() and path.suffix == ".gguf"):
        return path
    return None


def resolve_draft(draft: DraftWeights, cache_dir: Path) -> Path:
    """The speculative draft model's resolved directory (errors name the draft model)."""
    return resolve_source(draft.source, model_name=draft.name, cache_dir=cache_dir)


async def load_engine(
    name: str, config: ModelConfig, path: Path, server: Callable[[], ServerConfig]
) -> Engine:
    """Load the weights at `path` into the engine of the model's kind. `server` gives the live
    server settings (the SSD KV tier's root, media policy)."""
    # Imported here: each kind pulls in its own libraries (mlx-vlm only for a vlm).
    engine_class: type[LLMEngine] | type[EmbeddingEngine] | type[STTEngine] | type[TTSEngine]
    if config.kind == "llm":
        from mlxd.worker.llm import LLMEngine as engine_class
    elif config.kind == "vlm":
        from mlxd.worker.vlm import VLMEngine as engine_class
    elif config.kind == "embedding":
        from mlxd.worker.embedding import EmbeddingEngine as engine_class
    elif config.kind == "stt":
        from mlxd.worker.stt import STTEngine as engine_class
    elif config.kind == "tts":
        from mlxd.worker.tts import TTSEngine as engine_class
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
    try:
        path, need = await locate(name, config, server())
        await make_room(need)
        return await load_engine(name, config, path, server)
    finally:
        fresh_weights.discard()  # converted arrays no load took
