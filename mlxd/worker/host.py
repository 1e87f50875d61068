"""`python -m mlxd.worker`: one model's engine in a process of its own.

The daemon starts one worker per loaded model and talks to it over an inherited socket pair
(see `client.WorkerEngine` for the other end). A native crash, an abort or the OOM killer then
costs this model alone, and unloading the model is this process's exit, so its memory really
goes back to the system.

Life of a worker: read its `WorkerSpec`; at a lower CPU priority resolve the weights (a GGUF is
sized from its header, then converted on first use) and tell the daemon what it will hold (a
`MemoryNeed`); wait for the daemon to make room; load; restore the priority; say `ready`; then
serve requests until told to close, until the daemon goes away (end of file on the socket), or
until its engine's model thread dies.
Events travel back in one message per engine step, for every sequence at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import inspect
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxd.config import ModelConfig, ServerConfig
from mlxd.errors import MlxdError
from mlxd.logs import setup_logging
from mlxd.models import fresh_weights
from mlxd.process_exit import exit_process
from mlxd.runtime.engine import Engine
from mlxd.runtime.wire import WorkerSpec, read_message, write_message
from mlxd.settings import Settings
from mlxd.types import Event
from mlxd.worker import memory
from mlxd.worker.factory import load_engine, locate
from mlxd.worker.hooks import load_hooks
from mlxd.worker.jit_cache import keep_jit_cache

log = logging.getLogger("mlxd.worker")

# Loading (GGUF conversion, dequantization) runs this much nicer than serving, so a model
# that loads never starves the ones that stream.
LOAD_NICE = 10
WATCH_S = 0.1
# The engine methods the daemon may call; everything else is a message of its own.
CALLS = frozenset(
    {
        "count_prompt_tokens",
        "embed",
        "transcribe",
        "speak",
        "stats",
        "resize_cache",
        "attach_adapter",
        "detach_adapter",
    }
)
HOST_CALLS = frozenset({"stats"})  # answered by the host: the engine's figures and MLX's
EXIT_ENGINE_DIED = 3


class EngineHost:
    """Serves one loaded engine to the daemon."""

    def __init__(self, engine: Engine, writer: asyncio.StreamWriter, server: ServerHolder):
        self.engine = engine
        self.writer = writer
        self.server = server
        # Requests and calls in progress, by the daemon's id (one counter for both).
        self._tasks: dict[int, asyncio.Task] = {}
        self._outbox: list[tuple[int, Event]] = []
        self._death_told = False

    def describe(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "memory_bytes": self.engine.memory_bytes,
            "chat_template": getattr(self.engine, "chat_template", None),
            "tool_format": getattr(self.engine, "tool_format", None),
            "stats": self.stats(),
        }

    def stats(self) -> dict[str, Any]:
        return {**self.engine.stats(), **memory.figures()}

    async def serve(self, reader: asyncio.StreamReader) -> int:
        """Handle the daemon's messages; the exit status once done."""
        watcher = asyncio.create_task(self._watch_engine())
        try:
            while True:
                message = await read_message(reader)
                if message[0] == "close":
                    break
                self._handle(message)
        except (asyncio.IncompleteReadError, ConnectionError):
            log.warning("model '%s': the daemon went away; closing", self.engine.name)
        watcher.cancel()
        for task in list(self._tasks.values()):
            task.cancel()
        await self.engine.close()
        return 0

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind, *args = message
        if kind == "submit":
            self._start(args[0], self._generate(*args))
        elif kind == "call":
            self._start(args[0], self._call(*args))
        elif kind == "cancel":  # the caller went away: a cancelled task cancels its sequence
            task = self._tasks.get(args[0])
            if task is not None:
                task.cancel()
        elif kind == "server":
            self.server.current = args[0]
        else:
            log.error("unknown message from the daemon: %r", kind)

    def _start(self, tid: int, work: Any) -> None:
        task = asyncio.create_task(work)
        self._tasks[tid] = task
        task.add_done_callback(lambda _: self._tasks.pop(tid, None))

    async def _generate(self, rid: int, request: Any) -> None:
        try:
            events = await self.engine.submit(request)
        except Exception as exc:
            self._send(("rejected", rid, portable(exc)))
            return
        self._send(("accepted", rid, events.admission))
        async for event in events:
            self._queue(rid, event)

    async def _call(
        self, cid: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        try:
            if method not in CALLS:
                raise MlxdError(f"worker: no such call {method!r}")
            owner = self if method in HOST_CALLS else self.engine
            result = getattr(owner, method)(*args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
            self._send(("reply", cid, result))
        except Exception as exc:
            self._send(("error", cid, portable(exc)))

    def _queue(self, rid: int, event: Event) -> None:
        # A step's events reach their request tasks in one loop iteration; flushing on the
        # next one sends them all in one message.
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append((rid, event))

    def _flush(self) -> None:
        # A death is told before the errors it caused: whoever reads an error then already
        # sees the model as restarting.
        self._tell_death()
        if self._outbox:
            self._send(("events", self._outbox))
            self._outbox = []

    def _tell_death(self) -> None:
        failure = getattr(self.engine, "failure", None)
        if failure is not None and not self._death_told:
            self._send(("died", failure))
            self._death_told = True

    def _send(self, message: tuple[Any, ...]) -> None:
        if not self.writer.is_closing():
            write_message(self.writer, message)

    async def _watch_engine(self) -> None:
        """A dead model thread ends the worker: the daemon restarts the model in a fresh
        process, as for any other death."""
        while getattr(self.engine, "failure", None) is None:
            await asyncio.sleep(WATCH_S)
        await asyncio.sleep(WATCH_S)  # the failed requests' error events go out first
        self._flush()
        with contextlib.suppress(ConnectionError):
            await self.writer.drain()
        log.critical("model '%s': %s; worker exits", self.engine.name, self.engine.failure)
        exit_process(EXIT_ENGINE_DIED)


@dataclass
class ServerHolder:
    """The daemon's live server settings (a reload may change the media policy)."""

    current: ServerConfig


def portable(exc: BaseException) -> MlxdError:
    """`exc` as an error the daemon can unpickle and render."""
    if isinstance(exc, MlxdError):
        return exc
    return MlxdError(f"{type(exc).__name__}: {exc}")


# Loads a located model: (engine, what `ready` adds to `describe`). A distributed model's rank
# 0 loads with its group (worker/rank_cores.py).
Loader = Callable[
    [str, ModelConfig, Path, Callable[[], ServerConfig]], Awaitable[tuple[Engine, dict[str, Any]]]
]


async def _load_alone(
    name: str, config: ModelConfig, path: Path, server: Callable[[], ServerConfig]
) -> tuple[Engine, dict[str, Any]]:
    return await load_engine(name, config, path, server), {}


async def _start(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, load: Loader = _load_alone
) -> int:
    try:
        spec: WorkerSpec = await read_message(reader)
    except (asyncio.IncompleteReadError, ConnectionError):
        return 0  # a spare (runtime/spare_worker.py) whose daemon ended before giving it a model
    settings = Settings()  # MLXD_LOG_*, as the daemon resolved them
    setup_logging(settings.log_level, settings.log_format)
    server = ServerHolder(spec.server)
    load_hooks().before_load(spec.name)
    memory.apply_limits(spec.name, spec.server.metal)  # before the weights are allocated
    keep_jit_cache(spec.server.cache_dir)
    nice = _lower_priority()
    try:
        path, need = await locate(spec.name, spec.config, spec.server)
        write_message(writer, ("need", need))
        reply = await read_message(reader)  # the daemon made room for `need`, or could not
        if reply[0] != "go":
            return 1
        engine, extra = await load(spec.name, spec.config, path, lambda: server.current)
    except (asyncio.IncompleteReadError, ConnectionError):
        return 1  # the daemon gave up on this load
    except Exception as exc:
        if not isinstance(exc, MlxdError):
            log.exception("model '%s': unexpected load failure", spec.name)
        write_message(writer, ("load_failed", portable(exc)))
        await writer.drain()
        return 1
    finally:
        fresh_weights.discard()  # converted arrays no load took
    _restore_priority(nice)
    host = EngineHost(engine, writer, server)
    write_message(writer, ("ready", {**host.describe(), **extra}))
    return await host.serve(reader)


def _lower_priority() -> int:
    """Drop to LOAD_NICE above the current priority; returns the one to go back to."""
    nice = os.nice(0)
    with contextlib.suppress(OSError):
        os.nice(LOAD_NICE)
    return nice


def _restore_priority(nice: int) -> None:
    """Serve at the daemon's priority again. On Linux niceness is per thread and every thread
    made during the load (the model thread, MLX's and BLAS's pools) inherited the lower one."""
    tasks = Path("/proc/self/task")
    threads = [int(t) for t in os.listdir(tasks)] if tasks.is_dir() else [0]
    try:
        for thread in threads:
            os.setpriority(os.PRIO_PROCESS, thread, nice)
    except PermissionError:
        log.warning(
            "cannot raise the priority back after loading (needs CAP_SYS_NICE): this model "
            "serves at nice +%d",
            LOAD_NICE,
        )
    except OSError:
        pass  # a thread that ended meanwhile


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m mlxd.worker",
        description="Host one model's engine for the mlxd daemon (started by the daemon).",
    )
    to_daemon = parser.add_mutually_exclusive_group(required=True)
    to_daemon.add_argument("--fd", type=int, help="the inherited socket's fd")
    to_daemon.add_argument(
        "--connect",
        help="a rank of a distributed model (started by mlx.launch): rank 0 connects to the "
        "daemon's unix socket at this path, the other ranks follow rank 0",
    )
    args = parser.parse_args(argv)
    # A crash in native code (a kernel, MLX) leaves every thread's Python stack in the
    # daemon's log, not only "killed by SIGSEGV".
    faulthandler.enable()
    if args.connect is not None:
        exit_process(_rank(args.connect))

    async def run() -> int:
        sock = socket.socket(fileno=args.fd)
        return await _serve(*await asyncio.open_unix_connection(sock=sock))

    exit_process(asyncio.run(run()))  # see mlxd/process_exit.py: no interpreter teardown


async def _serve(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, load: Loader = _load_alone
) -> int:
    status = await _start(reader, writer, load)
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    return status


def _rank(path: str) -> int:
    """One rank of a distributed group: rank 0 serves the daemon, the others follow it."""
    import functools

    import mlx.core as mx

    from mlxd.worker import rank_cores as members

    world = mx.distributed.init(strict=True)
    if world.rank() != 0:
        settings = Settings()
        setup_logging(settings.log_level, settings.log_format)
        return members.follow(world)

    async def run() -> int:
        return await _serve(
            *await asyncio.open_unix_connection(path), functools.partial(members.lead, group=world)
        )

    return asyncio.run(run())


if __name__ == "__main__":
    main()
