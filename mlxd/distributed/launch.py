"""From a `distributed:` block to the argv that starts a group of ranks with `mlx.launch`.

mlx.launch does the remote work itself (ssh to each host, the same Python path there, the ring
or JACCL wiring, forwarding output); mlxd only writes its hostfile and argv. Every argument is a
list element: nothing goes through a shell.

Hostfile format (mlx/_distributed_utils/common.py `Hostfile.from_file`):
`{"backend": "ring", "envs": [], "hosts": [{"ssh": NAME, "ips": [IP], "rdma": []}, ...]}`, rank
order = list order. The ring backend needs an IP per host (it refuses bare hostnames), so names
in `hosts:` are resolved here; a host given as an IP keeps it, so `127.0.0.1` repeated runs
every rank on this machine.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from mlxd.config import DistributedConfig

# mlx.launch's own default; each loopback rank of a group listens on start + rank.
DEFAULT_STARTING_PORT = 32323


class LaunchError(RuntimeError):
    """A group cannot be started as declared (unresolvable host, no mlx.launch)."""


def host_ip(host: str) -> str:
    """`host` itself when it is an IP address, else its IPv4 address from the resolver."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        address = socket.getaddrinfo(host, None, family=socket.AF_INET)[0][4]
        # An AF_INET address is (host, port); the stub's union also covers other families.
        return cast(str, address[0])
    except (OSError, IndexError) as exc:
        raise LaunchError(f"cannot resolve host {host!r}: {exc}") from exc


def hostfile_data(distributed: DistributedConfig) -> dict[str, Any]:
    """The hostfile mlx.launch reads, for a block that lists `hosts`."""
    if distributed.hosts is None:
        raise ValueError("this block names a hostfile; pass that file to mlx.launch as it is")
    return {
        "backend": distributed.backend,
        "envs": [],
        "hosts": [{"ssh": host, "ips": [host_ip(host)], "rdma": []} for host in distributed.hosts],
    }


def write_hostfile(distributed: DistributedConfig, directory: Path) -> Path:
    """The hostfile to launch with: the block's own `hostfile`, or one written under
    `directory` from its `hosts`."""
    if distributed.hostfile is not None:
        return Path(distributed.hostfile)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "hostfile.json"
    path.write_text(json.dumps(hostfile_data(distributed), indent=2) + "\n", encoding="utf-8")
    return path


def is_loopback(distributed: DistributedConfig) -> bool:
    """Whether every rank runs on this machine (hosts all loopback addresses)."""
    hosts = distributed.hosts or []
    return bool(hosts) and all(_is_loopback_ip(host) for host in hosts)


def _is_loopback_ip(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def rank0_host(distributed: DistributedConfig) -> str:
    """The first rank's host: `hosts[0]`, or the hostfile's first host (its first IP, else
    its ssh name)."""
    if distributed.hosts is not None:
        return distributed.hosts[0]
    assert distributed.hostfile is not None  # the schema demands one of the two
    data = json.loads(Path(distributed.hostfile).read_text(encoding="utf-8"))
    first = (data["hosts"] if isinstance(data, dict) else data)[0]
    return str((first.get("ips") or [first["ssh"]])[0])


def is_local_host(host: str) -> bool:
    """Whether `host` is this machine: a loopback address, this host's name, or an address of
    one of its interfaces."""
    if _is_loopback_ip(host) or host in (socket.gethostname(), socket.getfqdn()):
        return True
    try:
        ip = host_ip(host)
    except LaunchError:
        return False
    if ipaddress.ip_address(ip).is_loopback:
        return True
    import psutil

    return any(ip == a.address for addrs in psutil.net_if_addrs().values() for a in addrs)


def loopback_hosts(ranks: int) -> list[str]:
    """`hosts:` for `ranks` ranks on this machine."""
    return ["127.0.0.1"] * ranks


def loopback_env(ranks: int) -> dict[str, str]:
    """Environment for ranks on this machine: the optimized BLAS preload mlxd itself uses
    (mlxd.accel; on the CPU backend float32 matmul is ~25x faster with it) and BLAS threads
    split between the ranks, which share this machine's cores."""
    from mlxd.accel import optimized_env

    env = optimized_env({})
    threads = max(1, (os.cpu_count() or 1) // ranks)
    env.setdefault("OPENBLAS_NUM_THREADS", str(threads))
    return env


def free_starting_port(
    ranks: int, *, first: int = DEFAULT_STARTING_PORT, taken: Collection[int] = ()
) -> int:
    """A port p from `first` on where p .. p+ranks-1 are all free on this machine now and not
    in `taken` (ports given to groups that may not have bound them yet). Best effort: another
    process may take one before the ranks bind. Two groups on one machine must not share
    ports, or the second group's ranks connect to the first's."""
    port = first
    while port + ranks <= 65535:
        span = range(port, port + ranks)
        if not any(p in taken for p in span) and all(_port_free(p) for p in span):
            return port
        port += ranks
    raise LaunchError("no free range of ports for the ranks")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def mlx_launch_command() -> list[str]:
    """MLX's `mlx.launch`, run by this interpreter through mlxd's shim (see launcher.py)."""
    return [sys.executable, "-m", "mlxd.distributed.launcher"]


def launch_argv(
    distributed: DistributedConfig,
    hostfile: Path,
    module: str,
    args: Sequence[str] = (),
    *,
    python: str | None = None,
    starting_port: int | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    launcher: Sequence[str] | None = None,
) -> list[str]:
    """argv starting every rank of the group as `<python> -m <module> <args>`.

    `python` defaults to this interpreter: mlx.launch runs the same path on remote hosts, so
    every host needs the environment at that path. `env` is set on every rank (e.g.
    LD_PRELOAD of an optimized BLAS); `cwd` is every rank's working directory.
    """
    argv = [*(launcher or mlx_launch_command())]
    argv += ["--backend", distributed.backend, "--hostfile", str(hostfile)]
    if starting_port is not None:
        argv += ["--starting-port", str(starting_port)]
    for key, value in (env or {}).items():
        argv += ["--env", f"{key}={value}"]
    if cwd is not None:
        argv += ["--cwd", cwd]
    return [*argv, "--", python or sys.executable, "-m", module, *args]
