"""The SSD tier: one safetensors file per block under cache_dir/kv/<model fingerprint>/.

Files are written by a writer thread (never on the model thread's critical path) to a temp
name and renamed into place, with a checksum of every tensor in their metadata. A file that is
torn, truncated, corrupt or not ours is deleted, never loaded. A file's mtime is its last use:
it orders budget eviction and `ssd_ttl` pruning, and survives restarts with the directory,
from which the index is rebuilt.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import mlx.core as mx
from safetensors import safe_open

from mlxd.cache.blocks import Block

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger("mlxd.cache")

FORMAT = "mlxd-kv/1"
SUFFIX = ".safetensors"
TMP_MARK = ".tmp"
PRUNE_EVERY_S = 60.0


@dataclass
class Entry:
    path: Path
    size: int
    mtime: float


def checksum(arrays: dict[str, mx.array]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(arrays):
        digest.update(name.encode())
        # mx.array has the buffer protocol; its stub does not declare it.
        digest.update(memoryview(cast("Buffer", arrays[name])))
    return digest.hexdigest()


class SsdTier:
    def __init__(
        self,
        directory: Path,
        fingerprint: str,
        budget: int,
        ttl: float | None,
        dtype: mx.Dtype | None = None,
    ):
        """`dtype`: what a block's keys and values (or their scales) must be, if known: a
        file of another (an older float32 cache's) is deleted, not loaded."""
        self.directory = directory
        self.dtype = dtype
        self.fingerprint = fingerprint
        self.budget = budget
        self.ttl = ttl
        self.nbytes = 0
        self.evictions = 0
        self._index: dict[str, Entry] = {}
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Block | None] = queue.SimpleQueue()
        self._scanned = False
        self._writer: threading.Thread | None = None
        if budget > 0:
            self._start()

    # -- any thread ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def put(self, block: Block) -> None:
        """Queue `block` for writing unless it is on disk (or on its way) already."""
        with self._lock:
            if self.budget <= 0 or block.key in self._index or block.key in self._pending:
                return
            self._pending.add(block.key)
        self._queue.put(block)

    def load(self, key: str, parent: str, tokens: list[int] | tuple[int, ...]) -> Block | None:
        """The block stored under `key` if its file is intact and holds this very prefix."""
        with self._lock:
            entry = self._index.get(key)
        if entry is None:
            return None
        try:
            loaded = mx.load(str(entry.path), return_metadata=True)
            # mx.load's return type covers every format; with metadata it is (arrays, metadata).
            assert isinstance(loaded, tuple)
            arrays, meta = loaded
            mx.eval(arrays)  # read the file here, on the caller's thread, not the model's
            stored = arrays.pop("tokens")
            intact = (
                meta.get("format") == FORMAT
                and meta.get("fingerprint") == self.fingerprint
                and meta.get("key") == key
                and meta.get("checksum") == checksum({**arrays, "tokens": stored})
                and self._holds_dtype(arrays)
            )
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            log.warning("kv cache: unreadable block %s (%s): deleted", entry.path.name, exc)
            intact = False
        if not intact:
            self._forget(key, delete=True)
            return None
        # tolist() is typed as any nesting of scalars; "tokens" is a 1-D int32 array.
        stored_tokens = tuple(cast(list[int], stored.tolist()))
        block = Block(key, meta["parent"], stored_tokens, arrays, source="ssd")
        if not block.matches(parent, tokens):
            return None  # a hash collision: another prefix owns this key
        now = time.time()
        with self._lock:
            entry.mtime = now
        try:
            os.utime(entry.path, (now, now))
        except OSError:
            self._forget(key)
        return block

    def _holds_dtype(self, arrays: dict[str, mx.array]) -> bool:
        """Every float array (not the packed integers of a quantized block) is `dtype`."""
        return self.dtype is None or all(
            a.dtype == self.dtype for a in arrays.values() if mx.issubdtype(a.dtype, mx.floating)
        )

    def resize(self, budget: int, ttl: float | None) -> None:
        with self._lock:
            self.budget, self.ttl = budget, ttl
        if budget > 0:
            self._start()
        self.prune()

    def prune(self, now: float | None = None) -> None:
        """Drop entries unused for `ttl`, then the least recently used beyond the budget."""
        now = time.time() if now is None else now
        with self._lock:
            by_age = sorted(self._index.items(), key=lambda item: item[1].mtime)
            expired = [k for k, e in by_age if self.ttl is not None and now - e.mtime > self.ttl]
            size = self.nbytes - sum(self._index[k].size for k in expired)
            over: list[str] = []
            for key, entry in by_age:
                if size <= max(self.budget, 0):
                    break
                if key not in expired:
                    over.append(key)
                    size -= entry.size
        for key in [*expired, *over]:
            if self._forget(key, delete=True):
                self.evictions += 1

    def flush(self) -> None:
        """Wait until every queued block is on disk."""
        if self._writer is None:
            return
        done = threading.Event()
        self._queue.put(done)  # type: ignore[arg-type]
        done.wait()

    def close(self) -> None:
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None

    # -- writer thread ---------------------------------------------------------------------

    def _start(self) -> None:
        if self._writer is not None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        if not self._scanned:
            self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="mlxd-kv-writer", daemon=True)
        self._writer.start()

    def _scan(self) -> None:
        """Rebuild the index from the directory (after a restart), deleting what cannot be used."""
        self._scanned = True
        for path in self.directory.iterdir():
            if not path.name.endswith(SUFFIX) or TMP_MARK in path.name or not self._valid(path):
                log.info("kv cache: deleting leftover or foreign file %s", path.name)
                path.unlink(missing_ok=True)
                continue
            stat = path.stat()
            self._index[path.name.removesuffix(SUFFIX)] = Entry(path, stat.st_size, stat.st_mtime)
            self.nbytes += stat.st_size
        self.prune()

    def _valid(self, path: Path) -> bool:
        """Header checks only (the checksum is verified on load): ours, complete, this model."""
        try:
            with safe_open(str(path), "numpy") as handle:  # rejects truncated files
                meta = handle.metadata() or {}
        except Exception:  # the library raises its own error types for every kind of damage
            return False
        return (
            meta.get("format") == FORMAT
            and meta.get("fingerprint") == self.fingerprint
            and meta.get("key") == path.name.removesuffix(SUFFIX)
        )

    def _write_loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=PRUNE_EVERY_S)
            except queue.Empty:
                self.prune()
                continue
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._write(item)
            except Exception:  # a full or read-only disk costs cache hits, never requests
                log.exception("kv cache: writing block %s failed", item.key)
            finally:
                with self._lock:
                    self._pending.discard(item.key)

    def _write(self, block: Block) -> None:
        final = self.directory / f"{block.key}{SUFFIX}"
        temp = self.directory / f"{block.key}.{uuid.uuid4().hex}{TMP_MARK}{SUFFIX}"
        arrays = {**block.arrays, "tokens": mx.array(block.tokens, dtype=mx.int32)}
        metadata = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "key": block.key,
            "parent": block.parent,
            "checksum": checksum(arrays),
        }
        try:
            mx.save_safetensors(str(temp), arrays, metadata=metadata)
            with open(temp, "rb+") as handle:
                os.fsync(handle.fileno())
            os.replace(temp, final)  # atomic: readers see no file or a whole one
        finally:
            temp.unlink(missing_ok=True)
        size = final.stat().st_size
        with self._lock:
            self._index[block.key] = Entry(final, size, time.time())
            self.nbytes += size
        self.prune()

    def _forget(self, key: str, delete: bool = False) -> bool:
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is not None:
                self.nbytes -= entry.size
        if entry is not None and delete:
            entry.path.unlink(missing_ok=True)
        return entry is not None
