"""The sha256 of an imported file (a GGUF, a CTranslate2 model.bin), which names its conversion
under the cache dir: the same content converts once, whatever its path.

Hashing a 4.6 GiB GGUF takes ≈3.5 s on one core with the page cache warm (≈10 s from disk), as
long as llama.cpp's whole cached load; so each digest is remembered under cache_dir/digests/ by
what changes whenever the file does (`remembered`), and a file no content like it was ever
converted from is hashed beside its conversion instead of before it (`probe`).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from contextlib import suppress
from pathlib import Path

from tqdm import tqdm

from mlxd.models.read_once import Passed

FOLDER = "digests"
_HASH_CHUNK = 8 << 20
_PROBE_BYTES = 16 << 20


def remembered(path: Path, cache_dir: Path) -> str | None:
    """The digest remembered for the very file at `path`, if any. It is keyed by device, inode,
    size, mtime and ctime: a copy is a new inode; a rewrite changes the mtime and the ctime,
    and no program can set the ctime back (utime sets it to now)."""
    with suppress(OSError, UnicodeDecodeError):
        text = _memo(path, cache_dir).read_text().strip()
        if len(text) == 64 and all(c in "0123456789abcdef" for c in text):
            return text
    return None


def digest(path: Path, cache_dir: Path, passed: Passed | None = None) -> str:
    """The sha256 of the file at `path` (hex): remembered, or hashed and remembered (`passed`
    told of each range read, models/read_once.py)."""
    if (known := remembered(path, cache_dir)) is not None:
        if passed is not None:
            passed(0, path.stat().st_size)
        return known
    memo = _memo(path, cache_dir)  # the file as it was before it was read
    hashed = sha256(path, passed)
    if _memo(path, cache_dir) == memo:  # not rewritten while it was read
        _write(memo, hashed)
    return hashed


def sha256(path: Path, passed: Passed | None = None) -> str:
    hasher = hashlib.sha256()
    read = 0
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
            hasher.update(chunk)
            bar.update(len(chunk))
            if passed is not None:
                passed(read, read + len(chunk))
            read += len(chunk)
    return hasher.hexdigest()


def probe(path: Path) -> str:
    """The file's size and the sha256 of its first 16 MiB (a GGUF's header, metadata and first
    tensors): equal for equal files, so a file whose probe was never `record`ed has no
    conversion yet, and its full digest can wait."""
    with path.open("rb") as f:
        head = hashlib.sha256(f.read(_PROBE_BYTES)).hexdigest()
    return f"{path.stat().st_size}-{head[:32]}"


def probed(probe: str, cache_dir: Path) -> bool:
    """Whether a file with this probe was converted (`record`)."""
    return _probe_path(probe, cache_dir).is_file()


def record(probe: str, digest: str, cache_dir: Path) -> None:
    """Note that a file with this probe, of this digest, was converted."""
    if not probed(probe, cache_dir):
        _write(_probe_path(probe, cache_dir), digest)


def _memo(path: Path, cache_dir: Path) -> Path:
    stat = path.stat()
    identity = f"{stat.st_dev}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}"
    return Path(cache_dir).expanduser() / FOLDER / hashlib.sha256(identity.encode()).hexdigest()


def _probe_path(probe: str, cache_dir: Path) -> Path:
    return Path(cache_dir).expanduser() / FOLDER / f"probe-{probe}"


def _write(path: Path, text: str) -> None:
    """Best effort, atomically: a reader sees the whole text or no file (the next load hashes
    again)."""
    with suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(handle, "w") as out:
            out.write(text)
        os.replace(partial, path)
