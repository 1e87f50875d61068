"""The weights this process has just converted into a model directory, held for its own load.

A GGUF's first load converts it into an MLX directory (models/gguf.py) that the load then reads
back, all of it when the CPU path packs the quantized layers: 6.4 GiB for an 8B Q4_K_M, from a
page cache that the conversion's own writes crowd. A worker loads the model it converted, so
the conversion hands its arrays here and the load takes them (models/loader.py) in place of the
directory's. One directory's at a time: another conversion (a GGUF draft model) replaces them,
and a load of another directory leaves them, so at worst one model's copy waits for a load
that reads its files instead.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path

import mlx.core as mx

_held: tuple[Path, dict[str, mx.array]] | None = None
_lock = threading.Lock()


def hold(model_dir: Path, arrays: Mapping[str, mx.array]) -> None:
    """Keep `arrays` (evaluated, named as the directory's safetensors name them) for a load
    of `model_dir`."""
    global _held
    with _lock:
        _held = (Path(model_dir).resolve(), dict(arrays))


def take(model_dir: Path) -> dict[str, mx.array]:
    """The arrays held for `model_dir`, released here (empty when none are)."""
    global _held
    with _lock:
        if _held is None or _held[0] != Path(model_dir).resolve():
            return {}
        arrays, _held = _held[1], None
    return arrays
