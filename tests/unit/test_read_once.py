"""models/read_once.py: a converted file's pages leave the page cache once every reader (the
conversion, the sha256 beside it) has passed them, and not before."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import pytest

from mlxd.models import read_once
from mlxd.models.read_once import ReadOnce, _Ranges
from mlxd.models.sources import resolve_source
from tests.conftest import NOT_APPLICABLE
from tests.unit.test_gguf import write_tiny_gguf

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def cached_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (mincore of a mapping that touches
    none of them)."""
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            assert _libc.mincore(address, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(byte & 1 for byte in vec)


def cache_whole(path: Path) -> None:
    with path.open("rb+") as f:
        os.fsync(f.fileno())  # dirty pages are not dropped
        while f.read(1 << 20):
            pass


def test_ranges_merge_and_intersect() -> None:
    ranges = _Ranges()
    for start, end in [(10, 20), (30, 40), (20, 25), (50, 60), (24, 31)]:
        ranges.add(start, end)
    assert ranges.overlap(0, 100) == [(10, 40), (50, 60)]
    assert ranges.overlap(15, 55) == [(15, 40), (50, 55)]
    assert ranges.overlap(40, 50) == []
    ranges.add(0, 100)
    assert ranges.overlap(5, 95) == [(5, 95)]


def test_a_range_is_dropped_once_every_reader_passed_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dropped: list[tuple[int, int]] = []
    monkeypatch.setattr(read_once, "_drop", lambda _path, start, end: dropped.append((start, end)))
    page = mmap.PAGESIZE
    path = tmp_path / "file"
    path.write_bytes(bytes(8 * page - 100))
    once = ReadOnce(path, 2)
    converter, hasher = once.reader(0), once.reader(1)
    converter(page, 2 * page)  # a tensor converted before the hash reached it
    converter(0, page)
    assert dropped == []
    hasher(0, page + page // 2)
    assert dropped == [(0, page + page // 2)]
    # The page the two drops share goes with the second, which passes its rest.
    hasher(page + page // 2, 8 * page - 100)
    assert dropped[-1] == (page, 2 * page)
    converter(3 * page + 10, 5 * page)  # [3 pages, +10) not converted yet: that page stays
    assert dropped[-1] == (3 * page + 10, 5 * page)
    converter(5 * page, 8 * page - 100)
    assert dropped[-1] == (5 * page, 8 * page)  # the file's last page too
    alone = ReadOnce(path, 1).reader(0)
    alone(7, 9)
    assert dropped[-1] == (7, 9)


def test_a_conversion_hands_the_file_back(tmp_path: Path) -> None:
    """A GGUF converted (and hashed beside it) leaves the page cache; a file read by neither
    stays."""
    control = tmp_path / "control"
    control.write_bytes(os.urandom(1 << 20))
    cache_whole(control)
    with control.open("rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if cached_pages(control) > 0:
        pytest.skip(f"{NOT_APPLICABLE} this filesystem keeps a file's pages (tmpfs?)")
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    other = write_tiny_gguf(tmp_path / "other.gguf")
    for path in (gguf, other):
        cache_whole(path)
    before = cached_pages(gguf)
    assert before == -(-gguf.stat().st_size // mmap.PAGESIZE)
    resolve_source(str(gguf), model_name="tiny", cache_dir=tmp_path / "cache")
    assert cached_pages(gguf) == 0
    assert cached_pages(other) == before
