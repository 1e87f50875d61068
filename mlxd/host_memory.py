"""The memory this process may use: the machine's, or less where a cgroup limits it.

psutil reads the machine's memory only. Inside a container started with `--memory 8g` on a
64 GiB host, or under a systemd unit's `MemoryMax=`, a default budget of 75% of the host is
48 GiB that the kernel's OOM killer ends at 8: the limit of every cgroup this process is in
(cgroup v2's `memory.max`, v1's `memory.limit_in_bytes`, each ancestor's too) bounds the total,
and what is left under it bounds what is available.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import psutil

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 writes "no limit" as the largest page-aligned 64-bit value; anything this large is
# no limit (no machine has 4 EiB).
_NO_LIMIT = 1 << 62


@dataclass(frozen=True)
class Memory:
    total: int  # bytes: physical memory, or the tightest cgroup limit below it
    available: int  # bytes: free and reclaimable (MemAvailable), and room under every limit


@dataclass(frozen=True)
class _Cgroup:
    limit: int
    usage: int  # bytes charged to the cgroup, less the page cache it reclaims first

    @property
    def room(self) -> int:
        return max(self.limit - self.usage, 0)


def memory() -> Memory:
    """The machine's total and available memory, each bounded by this process's cgroups."""
    machine = psutil.virtual_memory()
    total, available = machine.total, machine.available
    for group in _limited_cgroups(PROC_CGROUP, CGROUP_ROOT):
        total = min(total, group.limit)
        available = min(available, group.room)
    return Memory(total, available)


def _limited_cgroups(proc_cgroup: Path, root: Path) -> Iterator[_Cgroup]:
    """Every cgroup of this process with a memory limit, and each of their ancestors with one
    (a parent's limit holds its children too). Nothing where cgroups are not mounted."""
    with suppress(OSError):
        for line in proc_cgroup.read_text().splitlines():
            number, controllers, path = line.split(":", 2)
            if number == "0" and not controllers:  # v2: one hierarchy for every controller
                yield from _walk(root, path, _v2)
            elif "memory" in controllers.split(","):
                yield from _walk(root / "memory", path, _v1)


def _walk(mount: Path, path: str, read: Callable[[Path], _Cgroup | None]) -> Iterator[_Cgroup]:
    # A container's cgroup namespace shows its own cgroup as the root of the mount, while a v1
    # /proc/self/cgroup may still name the host's path, and a namespace names a cgroup outside
    # it with "..": where the path is not under the mount, the mount's root is this process's
    # cgroup (the nearest it can read; a limit above the namespace is not visible from inside).
    here = mount / path.strip("/")
    if ".." in Path(path).parts or not here.is_dir():
        here = mount
    for directory in (here, *here.parents):
        if directory != mount and mount not in directory.parents:
            break
        if (group := read(directory)) is not None:
            yield group


def _v2(directory: Path) -> _Cgroup | None:
    limit = _number(directory / "memory.max")
    if limit is None:  # "max", or no memory controller here (the root has no memory.max)
        return None
    usage = _number(directory / "memory.current") or 0
    return _Cgroup(limit, usage - _stat(directory, "inactive_file"))


def _v1(directory: Path) -> _Cgroup | None:
    limit = _number(directory / "memory.limit_in_bytes")
    if limit is None or limit >= _NO_LIMIT:
        return None
    usage = _number(directory / "memory.usage_in_bytes") or 0
    return _Cgroup(limit, usage - _stat(directory, "total_inactive_file"))


def _number(path: Path) -> int | None:
    with suppress(OSError, ValueError):
        return int(path.read_text().strip())
    return None


def _stat(directory: Path, key: str) -> int:
    """One field of the cgroup's memory.stat (0 when absent)."""
    with suppress(OSError, ValueError):
        for line in (directory / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0
