"""Read a GGUF file's header (metadata and tensor infos) and map its tensor data, lazily.

The `gguf` package's GGUFReader builds numpy views for every metadata string while it opens a file:
≈7 s for SmolLM2's 49k-token vocabulary on a 2-core machine, several times that for Llama 3's.
This reads the same header in one pass over a memory map (≈0.2 s) and leaves the tensor data on
disk until a tensor is converted; the format is GGUF v2/v3 as llama.cpp's gguf-py documents it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from mlxd.models.gguf_errors import GGUFError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value types → struct format of one scalar (8 = string, 9 = array).
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_NUMPY = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?"}
_NUMPY.update({10: "<u8", 11: "<i8", 12: "<f8"})
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # a string's byte count


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # row-major: GGUF lists dimensions innermost first, this does not
    offset: int  # absolute, in the file
    n_bytes: int


class _Cursor:
    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer, self.pos = buffer, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buffer):
            raise GGUFError("the header runs past the end of the file")
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """`count` strings (a byte count, then UTF-8), in one loop of locals: a Llama 3
        vocabulary and its merges are 400k strings, read at every load's sizing (≈3x faster
        than a `take` per length)."""
        unpack, buffer, size, pos = _LENGTH.unpack_from, self.buffer, len(self.buffer), self.pos
        texts: list[str] = []
        append = texts.append
        for _ in range(count):
            if pos + 8 > size:
                raise GGUFError("the header runs past the end of the file")
            (length,) = unpack(buffer, pos)
            pos += 8
            end = pos + length
            if end > size:
                raise GGUFError("a string runs past the end of the file")
            append(buffer[pos:end].decode("utf-8", errors="replace"))
            pos = end
        self.pos = pos
        return texts

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item == _STRING:
                return self.strings(count)
            if item in _NUMPY:
                dtype = np.dtype(_NUMPY[item])
                if self.pos + dtype.itemsize * count > len(self.buffer):
                    raise GGUFError("an array runs past the end of the file")
                array = np.frombuffer(self.buffer, dtype, count, self.pos)
                self.pos += dtype.itemsize * count
                return array.tolist()
            return [self.value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise GGUFError(f"unknown metadata value type {kind}")
        return self.take(_SCALARS[kind])


class GGUFFile:
    """A GGUF file's metadata and tensor infos; `data(tensor)` maps one tensor's bytes."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            with self.path.open("rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
            raise GGUFError(f"cannot read GGUF file {path}: {exc}") from exc
        try:
            self.metadata, self.tensors, self.alignment, self.data_start = self._parse()
        except (GGUFError, struct.error, UnicodeDecodeError, OverflowError) as exc:
            raise GGUFError(f"cannot read GGUF file {path}: {exc}") from exc
        self.unmap()  # parsed; touching the header mapped its neighbours too (fault-around)

    def _parse(self) -> tuple[dict[str, Any], list[TensorInfo], int, int]:
        """The metadata, the tensor infos, the data's alignment and where the data starts."""
        cursor = _Cursor(self._map)
        if self._map[:4] != _MAGIC:
            raise GGUFError("not a GGUF file (bad magic)")
        cursor.pos = 4
        version = cursor.take("I")
        if version not in (2, 3):
            raise GGUFError(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = cursor.take("Q"), cursor.take("Q")
        metadata = {}
        for _ in range(n_kv):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.take("I"))
        infos = []
        for _ in range(n_tensors):
            name = cursor.string()
            dims = [cursor.take("Q") for _ in range(cursor.take("I"))]
            raw_type, offset = cursor.take("I"), cursor.take("Q")
            infos.append((name, dims, raw_type, offset))
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-cursor.pos // alignment) * alignment
        tensors = []
        for name, dims, raw_type, offset in infos:
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise GGUFError(f"tensor {name!r} has unknown type {raw_type}") from None
            block, size = GGML_QUANT_SIZES[qtype]
            count = int(np.prod(dims))
            if dims and dims[0] % block:
                raise GGUFError(
                    f"tensor {name!r}: rows of {dims[0]} do not fill {qtype.name} blocks"
                )
            n_bytes = count // block * size
            if start + offset + n_bytes > len(self._map):
                raise GGUFError(f"tensor {name!r} runs past the end of the file (truncated?)")
            shape = tuple(int(d) for d in reversed(dims))
            tensors.append(TensorInfo(name, qtype, shape, start + offset, n_bytes))
        return metadata, tensors, alignment, start

    def data(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's raw bytes (uint8), mapped from the file: read only when used."""
        return np.frombuffer(self._map, np.uint8, tensor.n_bytes, tensor.offset)

    def span(self, tensor: TensorInfo) -> tuple[int, int]:
        """The file's bytes [start, end) that hold the tensor: its data and the padding after
        it (the next tensor starts aligned)."""
        end = tensor.offset + tensor.n_bytes
        return tensor.offset, min(-(-end // self.alignment) * self.alignment, self.size)

    @property
    def size(self) -> int:
        return len(self._map)

    def unmap(self) -> None:
        """Drop every page of the file from this process (they stay in the page cache)."""
        self._map.madvise(mmap.MADV_DONTNEED)

    def release(self, tensor: TensorInfo) -> None:
        """Drop the tensor's pages from this process (they stay in the page cache): without
        this a conversion's resident set grows by the whole file as it reads it."""
        start, end = self.span(tensor)
        start -= start % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
