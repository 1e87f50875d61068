"""The weights this process has just converted into a model directory, held for its own load.

A GGUF's first load converts it into an MLX directory (models/gguf.py) that the load then reads
back, all of it when the CPU path packs the quantized layers: 6.4 GiB for an 8B Q4_K_M, from a
page cache that the conversion's own writes crowd. A worker loads the model it converted, so
the conversion hands its arrays here and the packed load takes them (models/loader.py) in place
of the directory's; the worker lets go of what no load took (`discard`). One directory's at a
time: another conversion (a GGUF draft model) replaces them, and a load of another directory
leaves them, so at worst one model's copy waits for a load that reads its files instead.

Holding them costs memory the conversion did not use before (it kept two shards), at the
moment the daemon may still hold another model it is about to evict for this one: a conversion
holds arrays only while the machine keeps `FREE_SHARE` of its memory available
(`room_to_hold`), else it lets them go as they are written and the load reads the files.

Where the load will pack the quantized matrices (the CPU path decided from the GGUF's header
before converting: `packing`), the conversion packs each decoder matrix as it comes and holds
it packed instead (`Fresh.packed`): its converted arrays go once written, and their memory
takes the next tensor's. A first load of an 8B Q4_K_M then allocates the packed model once,
not the converted one first (6.3 GiB of fresh pages, which these VMs back at 1-2 s a GiB).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from mlxd import host_memory, kernels
from mlxd.accel import backend_name
from mlxd.kernels import Packed

# The share of the process's memory a conversion leaves available (the budget's default is the
# rest).
FREE_SHARE = 0.25


@dataclass
class Fresh:
    """What a conversion hands its process's load: arrays as the directory's safetensors name
    them, and quantized matrices already packed, by module name (models/packed.py)."""

    arrays: dict[str, mx.array] = field(default_factory=dict)
    packed: dict[str, Packed] = field(default_factory=dict)


@dataclass(frozen=True)
class PackLayout:
    """How the load will pack the quantized matrices (models/cpu_path.py's Choice)."""

    dot: bool
    precise: bool
    head_dot: bool | None = None  # the output head's, where it differs (None: dot)

    def dot_for(self, head: bool) -> bool:
        """Whether a matrix, the output head or not, packs as int8 dot products."""
        return self.head_dot if head and self.head_dot is not None else self.dot


_held: tuple[Path, Fresh] | None = None
_lock = threading.Lock()
# Set around a resolve_source whose conversion may pack (per task: asyncio.to_thread copies it).
_packing: ContextVar[PackLayout | None] = ContextVar("packing", default=None)


def hold(model_dir: Path, fresh: Fresh) -> None:
    """Keep `fresh` (evaluated arrays) for a load of `model_dir`."""
    global _held
    with _lock:
        _held = (Path(model_dir).resolve(), fresh)


def take(model_dir: Path) -> Fresh:
    """What is held for `model_dir`, released here (empty when nothing is)."""
    global _held
    with _lock:
        if _held is None or _held[0] != Path(model_dir).resolve():
            return Fresh()
        fresh, _held = _held[1], None
    return fresh


def discard() -> None:
    """Let go of whatever is held: a load that failed, or one of a kind that reads its files."""
    global _held
    with _lock:
        _held = None


@contextmanager
def packing(layout: PackLayout | None) -> Iterator[None]:
    """Conversions run meanwhile (in this context) pack the matrices as `layout` says (None:
    they hold arrays only)."""
    token = _packing.set(layout)
    try:
        yield
    finally:
        _packing.reset(token)


def pack_layout() -> PackLayout | None:
    """The layout a conversion running now packs in, if any (`packing`)."""
    return _packing.get()


def room_to_hold() -> bool:
    """Whether a conversion's arrays are worth holding: the load that takes them is the CPU's
    packed path (the kernels built, the CPU backend), and more than FREE_SHARE of the memory the
    process may use is available (free and reclaimable, under any cgroup limit:
    mlxd/host_memory.py)."""
    if backend_name() != "cpu" or not kernels.available():
        return False
    memory = host_memory.memory()
    return memory.available > FREE_SHARE * memory.total
