"""The memory mlxd may use: the machine's, bounded by the cgroups the process is in
(mlxd/host_memory.py), read from cgroup trees laid out as the kernel mounts them."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from mlxd import host_memory
from mlxd.config import ServerConfig

GIB = 2**30


def _files(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("__", ".")).write_text(text + "\n")


@pytest.fixture
def cgroups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cgroup mount and /proc/self/cgroup for the test to fill, on a machine of 64 GiB
    with 40 available."""
    monkeypatch.setattr(host_memory, "PROC_CGROUP", tmp_path / "proc-self-cgroup")
    monkeypatch.setattr(host_memory, "CGROUP_ROOT", tmp_path / "sys-fs-cgroup")
    machine = psutil.virtual_memory()._replace(total=64 * GIB, available=40 * GIB)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: machine)
    return tmp_path


def test_the_machine_bounds_the_memory_where_no_cgroup_limits_it() -> None:
    machine = psutil.virtual_memory().total
    assert 0 < host_memory.memory().total <= machine
    assert 0 < host_memory.memory().available <= machine


def test_a_v2_container_limit_bounds_the_total_and_what_is_left_under_it(cgroups: Path) -> None:
    # A container's namespace: its own cgroup is the mount's root.
    (cgroups / "proc-self-cgroup").write_text("0::/\n")
    _files(
        cgroups / "sys-fs-cgroup",
        memory__max=str(8 * GIB),
        memory__current=str(3 * GIB),
        memory__stat=f"anon {2 * GIB}\ninactive_file {GIB}\nactive_file 0",
    )
    memory = host_memory.memory()
    assert memory.total == 8 * GIB
    # 3 GiB charged, of which 1 GiB page cache the kernel reclaims first.
    assert memory.available == 6 * GIB
    assert ServerConfig().budget_bytes == 6 * GIB  # 75% of the container's 8 GiB
    assert ServerConfig(memory_budget="20GiB").budget_bytes == 20 * GIB  # as configured


def test_a_v2_unit_inherits_its_parents_limit(cgroups: Path) -> None:
    (cgroups / "proc-self-cgroup").write_text("0::/system.slice/mlxd.service\n")
    root = cgroups / "sys-fs-cgroup"
    _files(root / "system.slice", memory__max=str(4 * GIB), memory__current=str(GIB))
    _files(root / "system.slice" / "mlxd.service", memory__max="max", memory__current="0")
    assert host_memory.memory().total == 4 * GIB


def test_v1_limits_where_the_memory_controller_has_its_own_hierarchy(cgroups: Path) -> None:
    (cgroups / "proc-self-cgroup").write_text("5:cpu,cpuacct:/box\n4:memory:/box/inner\n0::/\n")
    memory_root = cgroups / "sys-fs-cgroup" / "memory"
    unlimited = "9223372036854771712"  # what v1 writes for no limit
    _files(memory_root, memory__limit_in_bytes=unlimited, memory__usage_in_bytes=str(9 * GIB))
    _files(memory_root / "box", memory__limit_in_bytes=str(2 * GIB), memory__usage_in_bytes="0")
    _files(memory_root / "box" / "inner", memory__limit_in_bytes=unlimited)
    assert host_memory.memory().total == 2 * GIB


def test_v1_inside_a_container_reads_the_mounts_root(cgroups: Path) -> None:
    # Docker on cgroup v1: /proc/self/cgroup names the host's path, the mount is the container's.
    (cgroups / "proc-self-cgroup").write_text("4:memory:/docker/0123abcd\n")
    _files(
        cgroups / "sys-fs-cgroup" / "memory",
        memory__limit_in_bytes=str(3 * GIB),
        memory__usage_in_bytes=str(GIB),
        memory__stat=f"total_inactive_file {GIB // 2}",
    )
    memory = host_memory.memory()
    assert memory.total == 3 * GIB
    assert memory.available == 3 * GIB - GIB // 2


def test_no_cgroups_mounted_is_the_machine(cgroups: Path) -> None:
    assert host_memory.memory() == host_memory.Memory(64 * GIB, 40 * GIB)  # no /proc/self/cgroup
    (cgroups / "proc-self-cgroup").write_text("0::/\n")  # v2 listed, nothing mounted
    assert host_memory.memory() == host_memory.Memory(64 * GIB, 40 * GIB)
    assert ServerConfig().budget_bytes == 48 * GIB


def test_a_cgroup_outside_the_namespace_reads_the_mounts_root(cgroups: Path) -> None:
    (cgroups / "proc-self-cgroup").write_text("0::/../../host.slice\n")
    _files(cgroups / "sys-fs-cgroup", memory__max=str(5 * GIB), memory__current="0")
    assert host_memory.memory().total == 5 * GIB
