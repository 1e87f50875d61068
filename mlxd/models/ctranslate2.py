"""Reading CTranslate2's model.bin: the variables a converter wrote, as numpy arrays.

The layout is what ctranslate2's `specs/model_spec.py` writes (binary version 6, little
endian): u32 version, the spec's name and u32 revision, u32 variable count, then per variable
its name, u8 rank, u32 dims, u8 dtype id, u32 byte count and the raw data; then u32 alias
count and (alias, target) name pairs. Strings are a u16 length (the NUL included), the bytes
and a NUL. Scalars (rank 0) carry the spec's settings (num_heads, pre_norm …).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# ctranslate2's dtype ids, in the order of its DataType enum.
_DTYPES = ("float32", "int8", "int16", "int32", "float16", "bfloat16")
_SUPPORTED_VERSIONS = (5, 6)


class CTranslate2Error(ValueError):
    """The file is not a CTranslate2 model this reader understands."""


@dataclass(frozen=True)
class CTranslate2Model:
    spec: str  # e.g. "WhisperSpec"
    revision: int
    variables: dict[str, np.ndarray]  # aliases resolved to their targets

    def scalar(self, name: str) -> int:
        return int(self.variables[name].reshape(()))


def spec_name(path: Path) -> str | None:
    """The spec a model.bin declares ("WhisperSpec" …), or None if it is not one."""
    try:
        with path.open("rb") as f:
            head = f.read(6 + 256)
        (version,) = struct.unpack_from("<I", head)
        if version not in _SUPPORTED_VERSIONS:
            return None
        return _Reader(head, 4).string()
    except (OSError, struct.error, UnicodeDecodeError, CTranslate2Error):
        return None


def read_model(path: Path) -> CTranslate2Model:
    data = path.read_bytes()
    reader = _Reader(data, 0)
    version = reader.unsigned("I")
    if version not in _SUPPORTED_VERSIONS:
        raise CTranslate2Error(f"{path}: CTranslate2 binary version {version} is not supported")
    spec = reader.string()
    revision = reader.unsigned("I")
    variables: dict[str, np.ndarray] = {}
    for _ in range(reader.unsigned("I")):
        name = reader.string()
        shape = [reader.unsigned("I") for _ in range(reader.unsigned("B"))]
        dtype_id = reader.unsigned("B")
        if dtype_id >= len(_DTYPES) or _DTYPES[dtype_id] == "bfloat16":
            raise CTranslate2Error(f"{path}: variable {name!r} has unsupported dtype {dtype_id}")
        raw = reader.take(reader.unsigned("I"))
        variables[name] = np.frombuffer(raw, dtype=_DTYPES[dtype_id]).reshape(shape)
    for _ in range(reader.unsigned("I")):
        alias, target = reader.string(), reader.string()
        variables[alias] = variables[target]
    if reader.offset != len(data):
        raise CTranslate2Error(f"{path}: {len(data) - reader.offset} bytes after the aliases")
    return CTranslate2Model(spec, revision, variables)


class _Reader:
    def __init__(self, data: bytes, offset: int):
        self.data = data
        self.offset = offset

    def unsigned(self, fmt: str) -> int:
        (value,) = struct.unpack_from("<" + fmt, self.data, self.offset)
        self.offset += struct.calcsize(fmt)
        return int(value)

    def take(self, size: int) -> bytes:
        if self.offset + size > len(self.data):
            raise CTranslate2Error("the file ends inside a variable")
        chunk = self.data[self.offset : self.offset + size]
        self.offset += size
        return chunk

    def string(self) -> str:
        raw = self.take(self.unsigned("H"))
        if not raw.endswith(b"\0"):
            raise CTranslate2Error("a name is not NUL-terminated")
        return raw[:-1].decode("utf-8")
