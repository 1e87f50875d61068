"""The kernels' packed layout of a model's quantized layers, kept under cache_dir/packed/ so that a
later load reads it instead of repacking.

Repacking MLX's quantized layout into the kernels' (models/packed.py) is numpy work over every
weight: most of a cached load's time (≈7 of 9 s for a Llama-3.2-1B Q4_K_M on 2 cores). The
packed arrays are written once, after a load packed them, into one safetensors file; MLX loads
it lazily, so each array is read when the model is evaluated and the stored layers it replaces
are never read at all.

The key says everything the arrays depend on, so a file is never stale:
- the weights: the model directory's path and the size, mtime, ctime and inode of each file
  in it (a converted GGUF's directory is named by the file's hash and never rewritten; a
  rewritten or replaced file changes its mtime, ctime or inode);
- the layout: the source of the code that writes it (mlxd/kernels/layout.py, csrc/convert.cpp
  and models/packed.py) and the ISA variant the kernels run, which reads it;
- the packing options: the int8 dot-product layout (x as one or two int8 terms:
  `cpu_activations`) or the float one (the CPU path plan, models/cpu_path.py; "mixed" keeps
  the float layout beside float32 weights it dequantizes).

Files live under `packed/<model directory key>/<key>.safetensors`: writing one removes the
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
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxd import kernels
from mlxd.kernels import Packed, layout
from mlxd.kernels.build import SOURCE_DIR
from mlxd.models.sources import exclusive
from mlxd.process_exit import before_exit

log = logging.getLogger(__name__)

FOLDER = "packed"
FORMAT = "mlxd-packed-1"
# The code that writes the layout: any change to it is a new layout (packability.py holds the
# width each stored width is packed at).
_LAYOUT_SOURCES = (
    Path(layout.__file__),
    SOURCE_DIR / "convert.cpp",  # which writes it
    SOURCE_DIR / "convert.h",
    Path(__file__).with_name("packed.py"),
    Path(__file__).with_name("packability.py"),
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


def layout_identity(dot: bool, precise: bool = True) -> dict[str, Any]:
    """The packing code, the ISA variant that reads its output, and the layout chosen."""
    sources = hashlib.sha256()
    for path in _LAYOUT_SOURCES:
        sources.update(path.read_bytes())
    return {
        "format": FORMAT,
        "sources": sources.hexdigest()[:32],
        "isa": kernels.isa(),
        "dot": dot,
        "precise": dot and precise,
    }


@dataclass(frozen=True)
class PackedCache:
    """One model's packed layers for one layout: `read` them, or `write` them once packed."""

    path: Path

    @classmethod
    def for_model(
        cls, cache_dir: Path, model_dir: Path, dot: bool, precise: bool = True
    ) -> PackedCache:
        weights = weights_identity(model_dir)
        key = _digest([weights, layout_identity(dot, precise)])
        folder = Path(cache_dir).expanduser() / FOLDER / _digest(weights["dir"])
        return cls(folder / f"{key}.safetensors")

    def read(self) -> dict[str, Packed] | None:
        """The packed layers by module name, lazily loaded; None when there is no readable file
        (each layer is still checked against its module before use: models/packed.py)."""
        if not self.path.is_file():
            return None
        try:
            arrays, metadata = mx.load(str(self.path), return_metadata=True)
            # A safetensors file always loads as two dicts.
            assert isinstance(arrays, dict) and isinstance(metadata, dict)
            if metadata.get("format") != FORMAT:
                raise ValueError(f"format {metadata.get('format')!r}, not {FORMAT}")
            layers = json.loads(metadata["layers"])
            return {
                name: Packed(
                    arrays[f"{name}.weight"],
                    arrays[f"{name}.scale_bias"],
                    int(bits),
                    bool(dot),
                    bool(precise),
                )
                for name, (bits, dot, precise) in layers.items()
            }
        except (RuntimeError, ValueError, KeyError, TypeError, AssertionError, OSError) as exc:
            # MLX checks every tensor's offsets against the file's size (a truncated file).
            log.warning("packed cache %s is unreadable, packing again: %s", self.path, exc)
            return None

    def write_in_background(self, layers: Mapping[str, Packed]) -> None:
        """`write` on a thread of its own, so the load does not wait for the disk (an 8B's
        4.6 GiB); the process waits for it before it exits (`wait_for_writes`)."""
        # Here: a layer read from an older file may still be lazy, and MLX arrays are
        # evaluated on the thread whose stream they belong to.
        mx.eval(
            [array for packed in layers.values() for array in (packed.weight, packed.scale_bias)]
        )
        thread = threading.Thread(
            target=self.write, args=(dict(layers),), name="packed-cache-write"
        )
        with _writes_lock:
            _writes.append(thread)
        before_exit(wait_for_writes)
        thread.start()

    def write(self, layers: Mapping[str, Packed]) -> None:
        """Store `layers` (evaluated) for the next load and drop other layouts of the same
        weights. Best effort: a full disk or read-only cache costs the next load a repacking."""
        arrays: dict[str, mx.array] = {}
        for name, packed in layers.items():
            arrays[f"{name}.weight"] = packed.weight
            arrays[f"{name}.scale_bias"] = packed.scale_bias
        meta = {name: [p.bits, p.dot, p.precise] for name, p in layers.items()}
        metadata = {"format": FORMAT, "layers": json.dumps(meta)}
        folder = self.path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with exclusive(folder / ".lock"):
                # Under the lock, whatever is here is another layout or a dead writer's.
                for other in folder.glob("*.safetensors"):
                    other.unlink(missing_ok=True)
                partial = folder / ".partial.safetensors"
                try:
                    mx.save_safetensors(str(partial), arrays, metadata=metadata)
                    partial.replace(self.path)  # readers never see half a file
                finally:
                    partial.unlink(missing_ok=True)
        except (OSError, RuntimeError) as exc:  # MLX reports a failed write as RuntimeError
            log.warning("could not keep the packed weights in %s: %s", folder, exc)
