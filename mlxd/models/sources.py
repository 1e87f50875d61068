"""Where weights come from: a YAML `source` string becomes a local MLX/Hugging Face model dir.

Forms: a local directory with config.json (a CTranslate2 Whisper directory, faster-whisper's
format, is imported once into the cache dir), a local `*.gguf` file (imported likewise),
`pkg://module/path` (a file or folder inside an installed package), `ollama://model[:tag]` (a
GGUF in Ollama's store, ollama_store.py) and `hf://org/repo[@revision]`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import snapshot_download
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

from mlxd import ollama_store
from mlxd.errors import ModelLoadError, TransientLoadError
from mlxd.models import file_digest, fresh_weights
from mlxd.models.ctranslate2 import CTranslate2Error
from mlxd.models.gguf import FORMAT_VERSION as GGUF_VERSION
from mlxd.models.gguf import GGUFError, convert_gguf
from mlxd.models.read_once import Passed, ReadOnce
from mlxd.models.source_paths import source_path
from mlxd.models.whisper_ct2 import FORMAT_VERSION as CT2_VERSION
from mlxd.models.whisper_ct2 import convert_ct2_whisper, is_ct2_whisper

log = logging.getLogger(__name__)

_TRUE = {"1", "on", "true", "yes"}
# Hashes a file beside its conversion (_convert_hashing).
_hasher = ThreadPoolExecutor(1, thread_name_prefix="file-digest")


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
    into, passed)`, at a `version` that is part of the key (a new importer never reuses an old
    output). `convert` tells `passed` which bytes of the weights file it is done with
    (models/read_once.py), and may return what it wrote (arrays, packed matrices): held for
    this process's load (models/fresh_weights.py)."""

    folder: str
    convert: Callable[[Path, Path, Passed], fresh_weights.Fresh | None]
    version: int


def _convert_ct2(source: Path, target: Path, passed: Passed) -> None:
    convert_ct2_whisper(source, target)
    passed(0, (source / "model.bin").stat().st_size)  # read whole, into memory


GGUF = Importer("gguf", convert_gguf, GGUF_VERSION)
CT2_WHISPER = Importer("ct2", _convert_ct2, CT2_VERSION)


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
    complete. A file whose digest is not remembered and whose probe no conversion recorded
    (models/file_digest.py) is hashed beside its conversion; any other is hashed first, and its
    directory reused. Locks (on the digest, or on the probe while the digest is not known) make
    concurrent importers of the same content wait for one conversion.
    """
    root = Path(cache_dir).expanduser() / importer.folder
    try:
        root.mkdir(parents=True, exist_ok=True)
        digest = digest or file_digest.remembered(weights, cache_dir)
        if digest is None:
            probe = file_digest.probe(weights)
            with exclusive(root / f".{probe}.lock"):
                if not file_digest.probed(probe, cache_dir):
                    return _convert_hashing(importer, path, weights, root, cache_dir, probe)
            digest = file_digest.digest(weights, cache_dir)
        final = root / _name(digest, importer)
        if not final.is_dir():
            with exclusive(root / f".{final.name}.lock"):
                if not final.is_dir():
                    with _scratch(root, final.name) as partial:
                        started = time.perf_counter()
                        fresh = importer.convert(path, partial, ReadOnce(weights, 1).reader(0))
                        _publish(partial, final, fresh, path, started)
                    # Whichever way the digest came (an Ollama blob's name, a remembered one):
                    # a copy of this content must find this conversion, not make another
                    # beside its hash. Recorded here, not at every load (a 16 MiB read).
                    file_digest.record(file_digest.probe(weights), digest, cache_dir)
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


def _convert_hashing(
    importer: Importer, path: Path, weights: Path, root: Path, cache_dir: Path, probe: str
) -> Path:
    """Convert while another thread computes the digest that names the result (the caller holds
    the probe's lock). The file's pages leave the page cache once both have read them."""
    once = ReadOnce(weights, 2)
    hashing = _hasher.submit(file_digest.digest, weights, cache_dir, once.reader(1))
    with _scratch(root, probe) as partial:
        started = time.perf_counter()
        fresh = importer.convert(path, partial, once.reader(0))
        digest = hashing.result()
        final = root / _name(digest, importer)
        with exclusive(root / f".{final.name}.lock"):
            if not final.is_dir():  # else the same content, converted meanwhile as a known digest
                _publish(partial, final, fresh, path, started)
    file_digest.record(probe, digest, cache_dir)
    return final


def _name(digest: str, importer: Importer) -> str:
    return f"{digest[:16]}-v{importer.version}"


@contextmanager
def _scratch(root: Path, stem: str) -> Iterator[Path]:
    """A temp dir under `root` for a conversion, removed unless renamed. Named after `stem`,
    whose lock the caller holds: leftovers of a crashed conversion of that stem go first."""
    for stale in root.glob(f".{stem}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{stem}.partial-", dir=root))
    try:
        yield partial
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _publish(
    partial: Path, final: Path, fresh: fresh_weights.Fresh | None, path: Path, started: float
) -> None:
    """Rename a finished conversion into place; hold what it wrote for this process's load
    (models/fresh_weights.py)."""
    os.rename(partial, final)
    if fresh is not None and (fresh.arrays or fresh.packed):
        fresh_weights.hold(final, fresh)
    log.info("converted %s into %s in %.1fs", path, final, time.perf_counter() - started)
