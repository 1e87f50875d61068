"""The kernels' packed layout of a model's quantized layers, kept under cache_dir/packed/ so that a
later load reads it instead of repacking.

Repacking MLX's quantized layout into the kernels' (models/packed.py) is numpy work over every
weight: most of a cached load's time (≈7 of 9 s for a Llama-3.2-1B Q4_K_M on 2 cores). The
packed arrays are written once, after a load packed them, into one file that a later load maps
(kernels.map_arrays): the arrays are the file's pages, taken from the page cache, not copies
made in fresh memory (a Llama-3.1-8B's 6 GiB: 0.02 s mapped, 3–6 s read by `mx.load` on this
project's 2-core VMs, whose fresh pages cost 4–9 µs each), and the stored layers they replace are
never read at all. Like llama.cpp's mapped GGUF, pages the kernel reclaims under pressure are
read again from the file, not lost.

The key says everything the arrays depend on, so a file is never stale:
- the weights: the model directory's path and the size, mtime, ctime and inode of each file
  in it (a converted GGUF's directory is named by the file's hash and never rewritten; a
  rewritten or replaced file changes its mtime, ctime or inode);
- the layout: the source of the code that writes it (mlxd/kernels/layout.py, csrc/convert.cpp
  and models/packed.py) and the ISA variant the kernels run, which reads it;
- the packing options: the int8 dot-product layout (x as one or two int8 terms:
  `cpu_activations`) or the float one (the CPU path plan, models/cpu_path.py; "mixed" keeps
  the float layout beside float32 weights it dequantizes).

The file: a little-endian uint64 header length, the JSON header (format, layers, and each array's
dtype, shape and offset from the data's start), then the arrays, each at a multiple of 64 bytes
with its byte count in the 8 bytes before it: MLX's CPU allocator keeps a buffer's size there, so
a mapped array is a buffer as it makes them (csrc/mapped.cpp). A layer's q, k and v projections
(models/fused.py's groups) are one array, their rows one after another, and the header's
`fused` names the parts and their rows: a load takes each part as a view of it, and fuses them
back into it without a copy (the concatenation copied 0.45 GiB of an 8B at every load, ≈1.1 of
its 3.1 s cached load on this project's 2-core VMs).

Beside the packed layers, the file keeps the model's other large arrays as the load made them
(`others`: an untied embedding with its scales and biases in float32, layers dequantized for
BLAS, a mixed plan's float32 copies), so that a cached load maps those too: a Llama-3.1-8B's
embedding (0.39 GiB) was read and cast at every load, 0.5 of its 1.0 s in the worker. An array
is taken from the file only where the model's own has the same name, shape and dtype (the key
covers the code that makes them, models/loader.py, and MLX's version).

Files live under `packed/<model directory key>/<key>.packed`: writing one removes the
others of the same directory (another layout, weights since rewritten), so the cache holds one
packed copy per model, as the conversion cache holds one converted copy per GGUF. Writes are
atomic (a temp file renamed into place) and happen beside the model's first requests, not
before them (the process waits for them before it exits); a missing, truncated or otherwise
unreadable file means packing again, never a failed load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxd import kernels
from mlxd.kernels import Packed, layout
from mlxd.kernels.build import SOURCE_DIR
from mlxd.models.direct_write import array_bytes
from mlxd.models.groups import fused_groups
from mlxd.models.sources import exclusive
from mlxd.process_exit import before_exit

log = logging.getLogger(__name__)

FOLDER = "packed"
FORMAT = "mlxd-packed-4"
SUFFIX = ".packed"
_ALIGN = 64  # each array's offset: a cache line, and room for the byte count before it
_DTYPES = {
    "uint8": mx.uint8,
    "uint32": mx.uint32,
    "int32": mx.int32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "float32": mx.float32,
}
# The other arrays worth mapping: an embedding, a dequantized layer; not a norm's few KiB.
OTHERS_MIN_BYTES = 1 << 20
_MAX_HEADER = 64 << 20  # a garbage length is not read as one
_OTHER = ":other"  # the suffix of an other array's name in the file (a layer's: .weight)
# The code that writes the layout: any change to it is a new layout (packability.py holds the
# width each stored width is packed at).
_LAYOUT_SOURCES = (
    Path(layout.__file__),
    SOURCE_DIR / "convert.cpp",  # which writes it
    SOURCE_DIR / "convert.h",
    Path(__file__).with_name("packed.py"),
    Path(__file__).with_name("packability.py"),
    Path(__file__).with_name("groups.py"),  # which layers are kept as one
    Path(__file__).with_name("loader.py"),  # which makes the other arrays (casts, dequantizing)
)


_writes: list[threading.Thread] = []  # background writes not yet waited for
_writes_lock = threading.Lock()


def wait_for_writes() -> None:
    """Return once every background write this process started has finished."""
    while True:
        with _writes_lock:
            if not _writes:
                return
            thread = _writes.pop()
        thread.join()


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def write_arrays(
    path: Path, arrays: Mapping[str, mx.array | list[mx.array]], header: dict[str, Any]
) -> None:
    """Write evaluated `arrays` and `header` (JSON) to `path` in the layout `read_arrays` maps.
    A list is written as one array: its pieces' concatenation along the first axis (made by
    the writes, not in memory)."""
    places: dict[str, list[Any]] = {}
    end = 0
    pieces = {name: a if isinstance(a, list) else [a] for name, a in arrays.items()}
    for name, parts in pieces.items():
        offset = _aligned(end + 8)
        shape = [sum(a.shape[0] for a in parts), *parts[0].shape[1:]]
        places[name] = [str(parts[0].dtype).removeprefix("mlx.core."), shape, offset]
        end = offset + sum(a.nbytes for a in parts)
    text = json.dumps({**header, "arrays": places}).encode()
    start = _aligned(8 + len(text))
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(text)) + text)
        for name, parts in pieces.items():
            file.seek(start + places[name][2] - 8)  # the gap before it stays a hole
            file.write(struct.pack("<Q", sum(a.nbytes for a in parts)))
            for part in parts:
                file.write(array_bytes(part))
        # On the disk before the caller's rename publishes it: after a crash a published file
        # whose pages never reached the disk would map as zeros, with nothing to tell.
        file.flush()
        os.fsync(file.fileno())


def read_arrays(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """The arrays and header `write_arrays` wrote to `path`, the arrays mapped from the file.
    ValueError (or KeyError, TypeError) for a file that is not one; OSError or RuntimeError
    for one that cannot be read. The header and the arrays come from one open: a file renamed
    over `path` meanwhile cannot pair this header with its arrays."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        if length > _MAX_HEADER:
            raise ValueError(f"a header of {length} bytes")
        header = json.loads(file.read(length))
        if header.get("format") != FORMAT:
            raise ValueError(f"format {header.get('format')!r}, not {FORMAT}")
        start = _aligned(8 + length)
        places = header.pop("arrays")
        specs = [
            (start + offset, tuple(shape), _DTYPES[dtype])
            for dtype, shape, offset in places.values()
        ]
        arrays, mapped = kernels.map_arrays(file, specs)
    if not mapped:
        log.info("packed weights in %s copied: this MLX's allocator cannot map them", path)
    return dict(zip(places, arrays, strict=True)), header


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def weights_identity(model_dir: Path) -> dict[str, Any]:
    """The model directory and, per file, what changes when it is rewritten or replaced."""
    model_dir = Path(model_dir).resolve()
    files = {}
    for path in sorted(model_dir.iterdir()):
        if path.is_file():
            stat = path.stat()
            files[path.name] = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
    return {"dir": str(model_dir), "files": files}


def layout_identity(
    dot: bool, precise: bool = True, head_dot: bool | None = None
) -> dict[str, Any]:
    """The packing code, the ISA variant that reads its output, and the layout chosen (the
    head's, named only where it differs from the layers')."""
    sources = hashlib.sha256()
    for path in _LAYOUT_SOURCES:
        sources.update(path.read_bytes())
    return {
        "format": FORMAT,
        "sources": sources.hexdigest()[:32],
        "isa": kernels.isa(),
        "mlx": getattr(mx, "__version__", ""),  # (the type stubs do not declare it)
        "dot": dot,
        "precise": (dot or bool(head_dot)) and precise,
    } | ({} if head_dot is None or head_dot == dot else {"head_dot": head_dot})


@dataclass(frozen=True)
class Kept:
    """What a file holds: the packed layers by module name, and the model's other large
    arrays by parameter path (models/loader.py `take_others`)."""

    layers: dict[str, Packed] = field(default_factory=dict)
    others: dict[str, mx.array] = field(default_factory=dict)


def keeps(array: mx.array) -> bool:
    """Whether a file keeps `array` among a model's others: large enough, and mappable."""
    return array.nbytes >= OTHERS_MIN_BYTES and array.dtype in _DTYPES.values()


@dataclass(frozen=True)
class PackedCache:
    """One model's packed layers for one layout: `read` them, or `write` them once packed."""

    path: Path

    @classmethod
    def for_model(
        cls,
        cache_dir: Path,
        model_dir: Path,
        dot: bool,
        precise: bool = True,
        head_dot: bool | None = None,
    ) -> PackedCache:
        weights = weights_identity(model_dir)
        key = _digest([weights, layout_identity(dot, precise, head_dot)])
        folder = Path(cache_dir).expanduser() / FOLDER / _digest(weights["dir"])
        return cls(folder / f"{key}{SUFFIX}")

    def stamp(self) -> tuple[int, int] | None:
        """What tells one file at `path` from the next (inode, mtime); None: no file."""
        try:
            stat = self.path.stat()
        except OSError:
            return None
        return stat.st_ino, stat.st_mtime_ns

    def read(self) -> Kept | None:
        """The packed layers and other arrays, mapped from the file; None when there is no
        readable file (each layer is still checked against its module before use:
        models/packed.py, each other array by models/loader.py `take_others`)."""
        if not self.path.is_file():
            return None
        try:
            arrays, header = read_arrays(self.path)
            layers = header["layers"]
            # A fused group's parts: views of its one array (a part that does not fit its
            # module is packed again: models/packed.py `fits`).
            views: dict[str, Packed] = {}
            for whole_name, parts in header.get("fused", {}).items():
                bits, dot, precise = layers[parts[0][0]]
                whole = Packed(
                    arrays[f"{whole_name}.weight"],
                    arrays[f"{whole_name}.scale_bias"],
                    int(bits),
                    bool(dot),
                    bool(precise),
                )
                first = 0
                for part, rows in parts:
                    views[part] = whole.rows(first, rows)
                    first += rows
            packed = {
                name: views.get(name)
                or Packed(
                    arrays[f"{name}.weight"],
                    arrays[f"{name}.scale_bias"],
                    int(bits),
                    bool(dot),
                    bool(precise),
                )
                for name, (bits, dot, precise) in layers.items()
            }
            return Kept(packed, {name: arrays[f"{name}{_OTHER}"] for name in header["others"]})
        except (
            RuntimeError,
            ValueError,
            KeyError,
            TypeError,
            AttributeError,  # a header of JSON values where objects belong
            OverflowError,  # int(Infinity)
            OSError,
            struct.error,
        ) as exc:
            log.warning("packed cache %s is unreadable, packing again: %s", self.path, exc)
            return None

    def write_in_background(self, kept: Kept, seen: tuple[int, int] | None) -> None:
        """`write` on a thread of its own, so the load does not wait for the disk (an 8B's
        4.6 GiB); the process waits for it before it exits (`wait_for_writes`)."""
        # Here: a layer packed by this load may still be lazy, and MLX arrays are evaluated
        # on the thread whose stream they belong to.
        packed = [array for p in kept.layers.values() for array in (p.weight, p.scale_bias)]
        mx.eval(packed, list(kept.others.values()))
        thread = threading.Thread(target=self.write, args=(kept, seen), name="packed-cache-write")
        with _writes_lock:
            _writes.append(thread)
        before_exit(wait_for_writes)
        thread.start()

    def write(self, kept: Kept, seen: tuple[int, int] | None) -> None:
        """Store `kept` (evaluated) for the next load and drop other layouts of the same
        weights, unless a file other than the one this load found (`seen`, its `stamp`
        before reading) took this key meanwhile: a process started beside a write still
        running (an 8B's takes 15–60 s) packs too, and the file the first wrote stands.
        Best effort: a full disk or read-only cache costs the next load a repacking."""
        layers = kept.layers
        fused = fused_groups(layers)
        in_groups = {part for parts in fused.values() for part in parts}
        arrays: dict[str, mx.array | list[mx.array]] = {}
        for name, packed in layers.items():
            if name not in in_groups:
                arrays[f"{name}.weight"] = packed.weight
                arrays[f"{name}.scale_bias"] = packed.scale_bias
        for whole, parts in fused.items():
            arrays[f"{whole}.weight"] = [layers[part].weight for part in parts]
            arrays[f"{whole}.scale_bias"] = [layers[part].scale_bias for part in parts]
        meta = {name: [p.bits, p.dot, p.precise] for name, p in layers.items()}
        groups = {
            whole: [[part, layers[part].shape[0]] for part in parts]
            for whole, parts in fused.items()
        }
        for name, array in kept.others.items():
            arrays[f"{name}{_OTHER}"] = array
        header = {"format": FORMAT, "layers": meta, "fused": groups, "others": list(kept.others)}
        folder = self.path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with exclusive(folder / ".lock"):
                if self.stamp() not in (None, seen):
                    log.info("packed weights in %s were written meanwhile: kept", self.path)
                    return
                # Under the lock, whatever is here is another layout, a dead writer's, or
                # an older mlxd's (safetensors, which cannot leave room before each array).
                for pattern in (f"*{SUFFIX}", "*.safetensors"):
                    for other in folder.glob(pattern):
                        other.unlink(missing_ok=True)
                partial = folder / f".partial{SUFFIX}"
                try:
                    write_arrays(partial, arrays, header)
                    partial.replace(self.path)  # readers never see half a file
                finally:
                    partial.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not keep the packed weights in %s: %s", folder, exc)
