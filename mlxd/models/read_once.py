"""A file that a conversion reads once (a GGUF, with its sha256 computed beside it): the pages
of it that every reader has passed leave the page cache as they go (POSIX_FADV_DONTNEED).

mlxd never reads the file again once it is converted, and the conversion fills as much new
memory as the file holds (an 8B Q4_K_M: 4.9 GB read, 5.5 GiB packed). Pages just freed are the
cheapest the conversion can get: on these VMs, whose host takes back the memory the guest frees
(virtio-balloon free page reporting), filling 4 GiB of pages never touched took 8.8–9.2 s and
0.5–0.9 s right after the file's cached pages were dropped; an 8B Q4_K_M's first load took
22.5 / 18.0 s before this and 15.8 / 14.2 s after (alternating). Elsewhere the machine holds one
copy of the weights instead of two. Pages another process maps stay (the kernel skips them).
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path

# A reader is done with the file's bytes [start, end).
Passed = Callable[[int, int], None]


class ReadOnce:
    """`readers` readers of the file at `path`, each reporting the byte ranges it is done with
    (`reader(i)`, from any thread); a range leaves the page cache once every reader passed it."""

    def __init__(self, path: Path, readers: int) -> None:
        self._path = path
        self._size = path.stat().st_size
        self._passed: list[_Ranges] = [_Ranges() for _ in range(readers)]
        self._lock = threading.Lock()

    def reader(self, index: int) -> Passed:
        return lambda start, end: self._pass(index, start, end)

    def _pass(self, index: int, start: int, end: int) -> None:
        with self._lock:
            self._passed[index].add(start, end)
            spans = [(start, end)]
            for other, ranges in enumerate(self._passed):
                if other != index:
                    spans = [span for s, e in spans for span in ranges.overlap(s, e)]
            spans = [self._whole_pages(s, e) for s, e in spans]
        for s, e in spans:
            _drop(self._path, s, e)

    def _whole_pages(self, start: int, end: int) -> tuple[int, int]:
        """[start, end) widened to the pages at its edges where every reader passed the rest of
        them (the kernel drops only whole pages; a tensor's edges share theirs)."""
        first, last = start - start % mmap.PAGESIZE, -(-end // mmap.PAGESIZE) * mmap.PAGESIZE
        if all(ranges.covers(first, start) for ranges in self._passed):
            start = first
        if all(ranges.covers(end, min(last, self._size)) for ranges in self._passed):
            end = last  # past the end of the file: its last page too
        return start, end


class _Ranges:
    """Disjoint, sorted byte ranges [start, end)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        # Every range that touches [start, end) merges with it.
        lo = bisect.bisect_left(self._ends, start)
        hi = bisect.bisect_right(self._starts, end)
        if lo < hi:
            start, end = min(start, self._starts[lo]), max(end, self._ends[hi - 1])
        self._starts[lo:hi], self._ends[lo:hi] = [start], [end]

    def covers(self, start: int, end: int) -> bool:
        if start >= end:
            return True
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and self._ends[i] >= end

    def overlap(self, start: int, end: int) -> list[tuple[int, int]]:
        lo = bisect.bisect_right(self._ends, start)
        hi = bisect.bisect_left(self._starts, end)
        return [
            (max(start, s), min(end, e))
            for s, e in zip(self._starts[lo:hi], self._ends[lo:hi], strict=True)
        ]


def _drop(path: Path, start: int, end: int) -> None:
    """Best effort: the pages wholly inside [start, end) leave the page cache (not on macOS,
    whose Python has no posix_fadvise)."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)
