"""The weights this process has just converted into a model directory, held for its own load.

A GGUF's first load converts it into an MLX directory (models/gguf.py) that the load then reads
back, all of it when the CPU path packs the quantized layers: 6.4 GiB for an 8B Q4_K_M, from a
page cache that the conversion's own writes crowd. A worker loads the model it converted, so
the conversion hands its arrays here and the packed load takes them (models/loader.py) in place
of the directory's; the worker lets go of what no load took (`discard`). One directory's at a
time: another conversion (a GGUF draft model) replaces them, and a load of another directory
leaves them, so at worst one model's copy waits for a load that reads its files instead.

Holding them costs memory the conversion did not use before (it kept two ~1 GiB shards), at the
moment the daemon may still hold another model it is about to evict for this one: a conversion
holds arrays only while the machine keeps `FREE_SHARE` of its memory available
(`room_to_hold`), else it lets them go as they are written and the load reads the files.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path

import mlx.core as mx

from mlxd import host_memory, kernels
from mlxd.accel import backend_name

# The share of the process's memory a conversion leaves available (the budget's default is the
# rest).
FREE_SHARE = 0.25

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


def discard() -> None:
    """Let go of whatever is held: a load that failed, or one of a kind that reads its files."""
    global _held
    with _lock:
        _held = None


def room_to_hold() -> bool:
    """Whether a conversion's arrays are worth holding: the load that takes them is the CPU's
    packed path (the kernels built, the CPU backend), and more than FREE_SHARE of the memory the
    process may use is available (free and reclaimable, under any cgroup limit:
    mlxd/host_memory.py)."""
    if backend_name() != "cpu" or not kernels.available():
        return False
    memory = host_memory.memory()
    return memory.available > FREE_SHARE * memory.total
