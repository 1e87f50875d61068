"""The daemon's side of a distributed model's group of ranks (see worker/rank_cores.py for theirs).

The worker of a model with `distributed:` is `mlx.launch … -- python -m mlxd.worker
--connect PATH`, in a session of its own. mlx.launch owns the ranks' stdio and cannot pass them
an inherited socket (nor over ssh), so the daemon listens on a unix socket in a private (0700)
directory and accepts one connection, rank 0's; from then on it is the same wire protocol as
any worker. Rank 0 must therefore run on this machine (`mlxd check` says so).

mlx.launch ends the whole group when a rank exits with an error; `RankGroup.watch` does not
rely on that alone: a rank that dies may leave rank 0 blocked in a collective, so the daemon
watches mlx.launch and every rank on this machine, and kills the launcher's process group (every
local rank) at the first death. Remote ranks end with their ssh session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
from pathlib import Path
from typing import Any

import psutil

from mlxd.config import DistributedConfig
from mlxd.distributed.config import rank_count
from mlxd.distributed.launch import (
    LaunchError,
    free_starting_port,
    is_local_host,
    is_loopback,
    launch_argv,
    loopback_env,
    rank0_host,
    write_hostfile,
)

log = logging.getLogger("mlxd.worker")

WATCH_S = 0.5
# Ports handed to this daemon's loopback groups: groups loading at once have not bound theirs
# yet, so a free-port probe alone would give two of them the same range.
_PORTS: set[int] = set()


class RankGroup:
    """A launched group: mlx.launch's process, its private directory, and once rank 0 has
    reported them, every rank's pid and host."""

    def __init__(
        self,
        config: DistributedConfig,
        process: asyncio.subprocess.Process,
        directory: Path,
        ports: range,
    ):
        self.config = config
        self.ports = ports
        self.process = process
        self.directory = directory
        self.ranks: list[dict[str, Any]] = []
        self.death: str | None = None  # the first rank seen dead, said in the model's failure
        self._handles: dict[int, psutil.Process] = {}
        self._killing: asyncio.Future[None] | None = None

    @classmethod
    async def launch(
        cls, name: str, config: DistributedConfig
    ) -> tuple[RankGroup, asyncio.StreamReader, asyncio.StreamWriter]:
        """Start every rank; return once rank 0 has connected (or the group has ended:
        ConnectionError)."""
        first = rank0_host(config)
        if not is_local_host(first):
            raise LaunchError(
                f"rank 0's host {first!r} is not this machine: rank 0 is the model's worker "
                "and must run where mlxd runs"
            )
        directory = Path(tempfile.mkdtemp(prefix=f"mlxd-{name}-"))  # 0700
        path = directory / "rank0.sock"
        connected: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
            asyncio.get_running_loop().create_future()
        )

        def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if connected.done():
                writer.close()  # only rank 0 connects; anything else is not ours
            else:
                connected.set_result((reader, writer))

        listener = await asyncio.start_unix_server(accept, path)
        group: RankGroup | None = None
        ports = range(0)
        try:
            ranks = rank_count(config)
            loopback = is_loopback(config)
            if loopback:
                start = free_starting_port(ranks, taken=_PORTS)
                ports = range(start, start + ranks)
                _PORTS.update(ports)
            argv = launch_argv(
                config,
                write_hostfile(config, directory),
                "mlxd.worker",
                ["--connect", str(path)],
                starting_port=ports[0] if ports else None,
                env=loopback_env(ranks) if loopback else None,
                cwd=os.getcwd(),
            )
            process = await asyncio.create_subprocess_exec(
                *argv,
                # A pipe nobody writes: mlx.launch forwards its stdin to the ranks and polls it
                # (on /dev/null, always readable, it would spin).
                stdin=asyncio.subprocess.PIPE,
                start_new_session=True,  # one process group: every local rank, killable at once
            )
            group = cls(config, process, directory, ports)
            ended = asyncio.ensure_future(process.wait())
            either: list[asyncio.Future[Any]] = [connected, ended]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            ended.cancel()
            if not connected.done():
                raise ConnectionError(f"the ranks ended before rank 0 connected ({argv[0]})")
            return group, *connected.result()
        except BaseException:
            if group is not None:
                await group.kill()
            else:
                _PORTS.difference_update(ports)
                shutil.rmtree(directory, ignore_errors=True)
            raise
        finally:
            listener.close()
            path.unlink(missing_ok=True)

    def started(self, ranks: list[dict[str, Any]]) -> None:
        """Rank 0's report of every rank ({rank, pid, host}) once the group loaded."""
        self.ranks = ranks
        here = socket.gethostname()
        for info in ranks:
            if info["host"] == here:
                with contextlib.suppress(psutil.Error):
                    self._handles[info["rank"]] = psutil.Process(info["pid"])

    def _alive(self, rank: int) -> bool | None:
        """None for a rank on another machine (not watched from here)."""
        handle = self._handles.get(rank)
        if handle is None:
            return None
        try:
            return handle.is_running() and handle.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def rss_bytes(self) -> int | None:
        """The local ranks' resident memory together: what this machine holds for the model."""
        total = 0
        for handle in self._handles.values():
            with contextlib.suppress(psutil.Error):
                total += handle.memory_info().rss
        return total or None

    def status(self) -> dict[str, Any]:
        """What /v1/status and `mlxd ps` show of the group."""
        return {
            "backend": self.config.backend,
            "strategy": self.config.strategy,
            "hosts": [info["host"] for info in self.ranks] or self.config.hosts,
            "launcher_pid": self.process.pid,
            "ranks": [
                {
                    **info,
                    "state": {True: "alive", False: "dead", None: "remote"}[
                        self._alive(info["rank"])
                    ],
                }
                for info in self.ranks
            ],
        }

    async def watch(self) -> None:
        """Until the group ends: at the first local rank found dead, or mlx.launch's exit, kill
        every local rank (rank 0 may be stuck in a collective with the dead one)."""
        while self.process.returncode is None and self.find_death() is None:
            await asyncio.sleep(WATCH_S)
        await self.kill()

    def find_death(self) -> str | None:
        """The first local rank seen dead, looking now (rank 0's own error about a lost peer
        is a symptom: the peer's death is what the model's failure should say). Another rank
        is named before rank 0, which exits after a peer's death."""
        if self.death is None:
            dead = [info for info in self.ranks if self._alive(info["rank"]) is False]
            dead.sort(key=lambda info: info["rank"] == 0)
            if dead:
                self.death = f"rank {dead[0]['rank']} (pid {dead[0]['pid']}) died"
        return self.death

    async def kill(self) -> None:
        """End every local rank and mlx.launch (SIGKILL to its process group), wait until
        they are gone, and remove the private directory. Callers may overlap: one kill runs."""
        if self._killing is None:
            self._killing = asyncio.ensure_future(self._kill())
        await asyncio.shield(self._killing)

    async def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        await self.process.wait()
        for rank, handle in self._handles.items():
            if self._alive(rank):  # not in the launcher's process group any more?
                log.warning("rank %d (pid %d) outlived its group; killing it", rank, handle.pid)
                with contextlib.suppress(psutil.Error):
                    handle.kill()
        await asyncio.to_thread(psutil.wait_procs, list(self._handles.values()), timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)
        _PORTS.difference_update(self.ports)
