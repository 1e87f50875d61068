"""A safetensors file written past the page cache (O_DIRECT), for the GGUF conversion's shards.

Writing a converted 8B's 6.4 GiB through the page cache cost more than converting it: every
page of the cache is fresh memory the kernel allocates, and on this project's 2-core VMs a
fresh page costs 4–9 µs. `convert_gguf` of a Llama-3.1-8B Q4_K_M took 28–43 s with its shards
written by `mx.save_safetensors` (34–50 s of system time) and 12–14 s with none written. Written
directly, the disk takes the bytes from a reused, aligned buffer (a few ms of system time a
GiB); the write overlaps the conversion as before, on its own thread.

The cost: the file is not in the page cache afterwards. On the CPU a later load reads little of
it (the packed layers come from models/packed_cache.py, which is written through the cache so
that the next load maps it); elsewhere a later load reads it from the disk. Filesystems without
O_DIRECT (tmpfs) get the ordinary write. The layout is safetensors' own (a little-endian uint64
header length, the JSON header padded to 8 bytes, the tensors back to back), so `mx.load` and
the `safetensors` package read it as any other.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import mlx.core as mx
import numpy as np

_DTYPES = {
    mx.bool_: "BOOL",
    mx.uint8: "U8",
    mx.uint16: "U16",
    mx.uint32: "U32",
    mx.uint64: "U64",
    mx.int8: "I8",
    mx.int16: "I16",
    mx.int32: "I32",
    mx.int64: "I64",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.float32: "F32",
    mx.float64: "F64",
}
_CHUNK = 8 << 20  # the aligned buffer the disk reads from; a multiple of any block size


def save_safetensors(
    path: Path, arrays: Mapping[str, mx.array], metadata: Mapping[str, str]
) -> None:
    """What `mx.save_safetensors(path, arrays, metadata)` writes (the same tensors and
    metadata; the header's JSON spelled its own way) for evaluated `arrays`, past the page
    cache."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, array in arrays.items():
        end = offset + array.nbytes
        header[name] = {
            "dtype": _DTYPES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensors start 8-aligned
    pieces = [struct.pack("<Q", len(text)) + text, *(array_bytes(a) for a in arrays.values())]
    try:
        _write_direct(path, pieces)
    except OSError as exc:
        # EINVAL: no O_DIRECT on this filesystem (tmpfs before Linux 6.6), or not for blocks
        # of this size; anything else (a full disk) is the caller's.
        if exc.errno != errno.EINVAL:
            raise
        with open(path, "wb") as file:
            for piece in pieces:
                file.write(piece)
            file.flush()
            os.fsync(file.fileno())


def _write_direct(path: Path, pieces: list[bytes | memoryview]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        total = _write_aligned(fd, pieces)
        os.ftruncate(fd, total)  # the last block was written whole
        # The size, and the drive's own cache: on the disk before the conversion's directory is
        # renamed into place (a crash would otherwise leave a published shard of zeros).
        os.fsync(fd)
    finally:
        os.close(fd)


def array_bytes(array: mx.array) -> bytes | memoryview:
    """An evaluated array's bytes, without a copy where it is row-contiguous (no MLX op: this
    runs on a thread of its own)."""
    # MLX arrays export the buffer protocol; their type stubs do not say so.
    view = memoryview(array)  # type: ignore[arg-type]
    if view.nbytes == 0:
        return b""
    return view.cast("B") if view.c_contiguous else view.tobytes()


def _write_aligned(fd: int, data: list[bytes | memoryview]) -> int:
    """Write `data` through one page-aligned buffer, whole chunks at a time (O_DIRECT writes
    whole blocks from aligned memory); the last one zero-padded. The bytes written, unpadded."""
    buffer = mmap.mmap(-1, _CHUNK)  # anonymous mappings are page-aligned
    staging = np.frombuffer(buffer, dtype=np.uint8)  # numpy copies into it without the GIL
    staged = total = 0
    for piece in data:
        source = np.frombuffer(piece, dtype=np.uint8)
        while len(source):
            taken = min(len(source), _CHUNK - staged)
            staging[staged : staged + taken] = source[:taken]
            staged, total, source = staged + taken, total + taken, source[taken:]
            if staged == _CHUNK:
                _write_whole(fd, memoryview(buffer))
                staged = 0
    if staged:
        staging[staged:] = 0
        padded = -(-staged // mmap.PAGESIZE) * mmap.PAGESIZE
        _write_whole(fd, memoryview(buffer)[:padded])
    del staging  # the mapping closes once no view of it is left
    buffer.close()
    return total


def _write_whole(fd: int, block: memoryview) -> None:
    """One aligned block; a short write (a disk filling up) is a failed one: what is left
    of the block would not start aligned."""
    written = os.write(fd, block)
    if written != len(block):
        raise OSError(errno.ENOSPC, f"wrote {written} of {len(block)} bytes")
