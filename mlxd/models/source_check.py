"""`mlxd check`'s look at each model's weights before any load: an Ollama model that is not in
the store, a GGUF whose header names what the importer cannot take (loader.ExtraCheck)."""

from __future__ import annotations

from pathlib import Path

from mlxd import ollama_store
from mlxd.config import Config
from mlxd.config.loader import Loc
from mlxd.errors import ModelLoadError
from mlxd.models.gguf import inspect_gguf
from mlxd.models.source_paths import source_path


def check_sources(config: Config) -> list[tuple[Loc, str]]:
    problems: list[tuple[Loc, str]] = []
    for name, model in config.models.items():
        loc: Loc = ("models", name, "source")
        problems += [(loc, message) for message in source_problems(name, model.source)]
    return problems


def source_problems(name: str, source: str) -> list[str]:
    """Why model `name`'s `source` cannot load, as far as a look at the files tells."""
    if not source.startswith(("pkg://", ollama_store.SCHEME)) and "://" in source:
        return []  # remote: only the load can tell
    try:
        path = source_path(source, model_name=name)
    except ModelLoadError as exc:
        # An Ollama model missing from the store; a missing package or path is the load's
        # to report (configs are often checked on another machine than the one serving).
        return [exc.message] if source.startswith(ollama_store.SCHEME) else []
    if not _is_gguf(path, source):
        return []
    return [f"model '{name}': {path.name}: {problem}" for problem in inspect_gguf(path)]


def _is_gguf(path: Path, source: str) -> bool:
    return path.is_file() and (path.suffix == ".gguf" or source.startswith(ollama_store.SCHEME))
