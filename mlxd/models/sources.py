"""Where weights come from: a YAML `source` string becomes a local MLX/Hugging Face model dir.

Forms: a local directory with config.json (a CTranslate2 Whisper directory, faster-whisper's
format, is imported once into the cache dir), a local `*.gguf` file (imported likewise),
`pkg://module/path` (a file or folder inside an installed package), `ollama://model[:tag]` (a
GGUF in Ollama's store, ollama_store.py) and `hf://org/repo[@revision]`.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from huggingface_hub import snapshot_download
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS
from tqdm import tqdm

from mlxd import ollama_store
from mlxd.errors import ModelLoadError, TransientLoadError
from mlxd.models import fresh_weights
from mlxd.models.ctranslate2 import CTranslate2Error
from mlxd.models.gguf import FORMAT_VERSION as GGUF_VERSION
from mlxd.models.gguf import GGUFError, convert_gguf
from mlxd.models.source_paths import source_path
from mlxd.models.whisper_ct2 import FORMAT_VERSION as CT2_VERSION
from mlxd.models.whisper_ct2 import convert_ct2_whisper, is_ct2_whisper

log = logging.getLogger(__name__)

_HASH_CHUNK = 8 << 20
_TRUE = {"1", "on", "true", "yes"}


def resolve_source(source: str, *, model_name: str, cache_dir: Path) -> Path:
    """Return a local directory holding config.json, safetensors and tokenizer files.

    Raises ModelLoadError naming `model_name` for every failure.
    """
    if source.startswith("hf://"):
        return _check_model_dir(_hf_snapshot(source, model_name), source, model_name)
    path = source_path(source, model_name=model_name)
    if source.startswith(ollama_store.SCHEME):
        # The blob's name is its sha256: no need to hash gigabytes again.
        digest = path.name.removeprefix("sha256-")
        return _converted(GGUF, path, path, model_name, cache_dir, digest)
    if path.is_dir() and is_ct2_whisper(path):
        return _converted(CT2_WHISPER, path, path / "model.bin", model_name, cache_dir)
    if path.is_dir():
        return _check_model_dir(path, source, model_name)
    if path.is_file() and path.suffix == ".gguf":
        return _converted(GGUF, path, path, model_name, cache_dir)
    if path.exists():
        raise ModelLoadError(
            f"model '{model_name}': source {source!r} ({path}) is neither a model directory "
            "nor a .gguf file"
        )
    raise ModelLoadError(f"model '{model_name}': source {source!r} does not exist ({path})")


def _check_model_dir(path: Path, source: str, model_name: str) -> Path:
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"model '{model_name}': source {source!r} ({path}) has no config.json; "
            "expected a model directory in MLX/Hugging Face layout or a .gguf file"
        )
    return path


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
    raise TransientLoadError(
        f"model '{model_name}': could not fetch {source!r} {where} and no complete local "
        f"snapshot exists in {cache or 'the default Hugging Face cache'}: {error}"
    ) from error


def _file_digest(path: Path, cache_dir: Path) -> str:
    """The sha256 of the file at `path`, remembered under cache_dir/digests/ by what changes
    whenever the file does: device, inode, size, mtime and ctime (hashing a 4.6 GiB GGUF
    takes ≈3 s, as long as llama.cpp's whole cached load). A copy is a new inode; a rewrite
    changes the mtime and the ctime, and no program can set the ctime back (utime sets it
    to now), so a remembered digest is only used for the very file it was computed from."""
    stat = path.stat()
    identity = f"{stat.st_dev}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}"
    memo = Path(cache_dir).expanduser() / "digests" / hashlib.sha256(identity.encode()).hexdigest()
    with suppress(OSError, UnicodeDecodeError):
        remembered = memo.read_text().strip()
        if len(remembered) == 64 and all(c in "0123456789abcdef" for c in remembered):
            return remembered
    digest = _sha256(path)
    with suppress(OSError):  # best effort: the next load hashes again
        memo.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(prefix=f".{memo.name}.", dir=memo.parent)
        with os.fdopen(handle, "w") as out:
            out.write(digest)
        os.replace(partial, memo)
    return digest


def _sha256(path: Path) -> str:
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
def exclusive(lock_path: Path) -> Iterator[None]:
    """An flock held while converting; the kernel drops it if the process dies."""
    with lock_path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@dataclass(frozen=True)
class Importer:
    """A foreign format imported into the cache: under cache_dir/<folder>/, by `convert(path,
    into)`, at a `version` that is part of the key (a new importer never reuses an old output).
    `convert` may return the arrays it wrote: they are held for this process's load
    (models/fresh_weights.py)."""

    folder: str
    convert: Callable[[Path, Path], Mapping[str, mx.array] | None]
    version: int


GGUF = Importer("gguf", convert_gguf, GGUF_VERSION)
CT2_WHISPER = Importer("ct2", convert_ct2_whisper, CT2_VERSION)


def _converted(
    importer: Importer,
    path: Path,
    weights: Path,
    model_name: str,
    cache_dir: Path,
    digest: str | None = None,
) -> Path:
    """Import `path` once into cache_dir/<folder>/<sha256[:16] of `weights`>-v<version>/ and
    reuse it (`digest`: that sha256, when already known).

    The directory only ever appears by renaming a finished temp dir, so its existence means it is
    complete; the lock makes concurrent importers of the same file wait for one conversion.
    """
    digest = f"{(digest or _file_digest(weights, cache_dir))[:16]}-v{importer.version}"
    root = Path(cache_dir).expanduser() / importer.folder
    final = root / digest
    if final.is_dir():
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        with exclusive(root / f".{digest}.lock"):
            if final.is_dir():
                return final
            # Leftovers of a crashed conversion: nobody else can hold this digest's lock.
            for stale in root.glob(f".{digest}.partial-*"):
                shutil.rmtree(stale, ignore_errors=True)
            partial = Path(tempfile.mkdtemp(prefix=f".{digest}.partial-", dir=root))
            try:
                started = time.perf_counter()
                arrays = importer.convert(path, partial)
                os.rename(partial, final)
                if arrays:
                    fresh_weights.hold(final, arrays)
                log.info(
                    "converted %s into %s in %.1fs", path, final, time.perf_counter() - started
                )
            finally:
                shutil.rmtree(partial, ignore_errors=True)
    except (GGUFError, CTranslate2Error) as exc:
        raise ModelLoadError(f"model '{model_name}': {exc}") from exc
    except OSError as exc:  # a full disk: it may pass
        raise TransientLoadError(
            f"model '{model_name}': could not convert {path} into {root}: {exc}"
        ) from exc
    except Exception as exc:  # metadata the importer did not expect
        raise ModelLoadError(
            f"model '{model_name}': could not convert {path} into {root}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return final
