"""Converted tensors written as safetensors shards while the conversion goes on
(models/gguf.py), and the JSON files beside them."""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxd.models import direct_write, fresh_weights

# Small enough that the arrays waiting for the disk (two shards) are a small part of a load
# whose conversion packs (those are not held): an 8B Q4_K_M's conversion peaked at 6.7 GiB
# resident with 1 GiB shards, 5.9 GiB with these (its packed matrices 5.1 GiB).
SHARD_BYTES = 256 << 20


class ShardWriter:
    """Writes converted tensors into ~256 MiB safetensors shards as they come, each on a thread of
    its own while the next fills, past the page cache (models/direct_write.py): the disk and
    the conversion overlap, and at most two shards are held."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.pending: dict[str, mx.array] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        # Every array added, by name; None once there was no room to hold them
        # (models/fresh_weights.py).
        self.written: dict[str, mx.array] | None = {}
        self._disk = ThreadPoolExecutor(1, thread_name_prefix="gguf-shards")
        self._writing: Future[None] | None = None

    def add(self, name: str, array: mx.array, hold: bool = True) -> None:
        """Add an evaluated array (the writing thread only reads it), kept in `written` for
        the load if `hold`."""
        if self.written is not None and hold:
            self.written[name] = array
        self.pending[name] = array
        self.pending_bytes += array.nbytes
        if self.pending_bytes >= SHARD_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        # Asked once a shard (the most a writer holds anyway) has filled: the answer reads
        # /proc and the cgroup's files.
        if self.written is not None and not fresh_weights.room_to_hold():
            self.written = None  # those held go once their shards are written
        path = self.out_dir / f"shard-{len(self.files):05d}.safetensors"
        self._wait()
        self._writing = self._disk.submit(
            direct_write.save_safetensors, path, self.pending, {"format": "mlx"}
        )
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def _wait(self) -> None:
        """Wait for the shard being written; raises what its write raised."""
        if self._writing is not None:
            writing, self._writing = self._writing, None
            writing.result()

    def close(self) -> None:
        """Wait for any write still running (a failed conversion's too), raising nothing."""
        self._disk.shutdown(wait=True)

    def finish(self) -> None:
        """Name the shards as mlx-lm and Hugging Face expect, with an index if there are many."""
        self.flush()
        self._wait()
        if len(self.files) == 1:
            self.files[0][0].rename(self.out_dir / "model.safetensors")
            return
        index: dict[str, str] = {}
        for number, (path, names) in enumerate(self.files, 1):
            final = f"model-{number:05d}-of-{len(self.files):05d}.safetensors"
            path.rename(self.out_dir / final)
            index.update(dict.fromkeys(names, final))
        write_json(self.out_dir / "model.safetensors.index.json", {"weight_map": index})


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
