"""A worker process's start and end, outside its messages.

`start_worker` spawns `python -m mlxd.worker` on an inherited socket pair (for a distributed
model, mlx.launch and its group of ranks: runtime/rank_group.py) and walks it through its load
(worker/host.py is the other side): its spec, what it will hold, the go once the daemon made
room, then `ready` or why it could not load. A worker that ends before it is ready is a
`WorkerDied`; one refused, failed or cancelled on the way is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import psutil

from mlxd.config import ModelConfig, ServerConfig
from mlxd.distributed.launch import LaunchError
from mlxd.errors import TransientLoadError
from mlxd.memory_need import MemoryNeed
from mlxd.runtime import spare_worker
from mlxd.runtime.rank_group import RankGroup
from mlxd.runtime.wire import WorkerSpec, read_message, write_message

MakeRoom = Callable[[MemoryNeed], Awaitable[None]]


class WorkerProcess(Protocol):
    """What the daemon uses of a worker's process: asyncio's, or a spare's adopted one."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def kill(self) -> None: ...

    async def wait(self) -> int: ...


class WorkerDied(TransientLoadError):
    """The worker process ended before it was ready."""


@dataclass
class StartedWorker:
    """A worker whose model is loaded: its process (mlx.launch for a group of ranks), the
    daemon's end of its socket, its `ready` message and what it said it would hold."""

    process: WorkerProcess
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    ready: dict[str, Any]
    group: RankGroup | None
    need: MemoryNeed | None


async def start_worker(
    name: str, config: ModelConfig, server: Callable[[], ServerConfig], make_room: MakeRoom
) -> StartedWorker:
    """Spawn a worker for `name` (a group of ranks for a distributed model) and wait until
    its model is loaded. `make_room(need)` runs once the worker knows what it will hold,
    before it loads (raising refuses)."""
    group: RankGroup | None = None
    process: WorkerProcess
    if config.distributed is not None:
        try:
            group, reader, writer = await RankGroup.launch(name, config.distributed)
        except (LaunchError, ConnectionError) as exc:
            raise WorkerDied(f"model '{name}': cannot start its ranks: {exc}") from None
        process = group.process
    else:
        process, reader, writer = await _spawn()
    try:
        write_message(writer, WorkerSpec.without_keys(name, config, server()))
        kind, *args = await read_message(reader)
        need: MemoryNeed | None = None
        if kind == "need":
            need = args[0]
            await make_room(need)
            write_message(writer, ("go",))
            kind, *args = await read_message(reader)
        if kind == "load_failed":
            raise args[0]
        if kind != "ready":
            raise TransientLoadError(f"model '{name}': unexpected worker message {kind!r}")
    except (asyncio.IncompleteReadError, ConnectionError):
        status = await process.wait()
        writer.close()
        if group is None:
            ended = f"worker {describe_exit(status)}"
        else:
            await group.kill()
            ended = "group of ranks ended (mlx.launch forwards each rank's output to this log)"
        raise WorkerDied(f"model '{name}': {ended} while loading") from None
    except BaseException:  # refused, failed or cancelled (a reconcile superseded the load)
        writer.close()
        await (group.kill() if group is not None else reap(process))
        raise
    return StartedWorker(process, reader, writer, args[0], group, need)


def describe_exit(status: int) -> str:
    """'was killed by SIGKILL', 'exited with status 3' …"""
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        hint = " (out of memory?)" if name == "SIGKILL" else ""
        return f"was killed by {name}{hint}"
    return f"exited with status {status}"


async def _spawn() -> tuple[WorkerProcess, asyncio.StreamReader, asyncio.StreamWriter]:
    """`python -m mlxd.worker` on an inherited socket pair (the spare where there is one:
    runtime/spare_worker.py); the daemon's end."""
    process: WorkerProcess
    if (spare := spare_worker.take()) is not None:
        process, parent = spare
    else:
        parent, child = socket.socketpair()
        with child:
            process = await asyncio.create_subprocess_exec(
                *spare_worker.worker_command(child.fileno()),
                **spare_worker.spawn_options(child.fileno()),
            )
    try:
        return process, *await asyncio.open_unix_connection(sock=parent)
    except BaseException:  # cancelled (a superseded load): the worker is ours to end
        parent.close()
        await reap(process)
        raise


async def reap(process: WorkerProcess) -> None:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    await process.wait()


def process_handle(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None
