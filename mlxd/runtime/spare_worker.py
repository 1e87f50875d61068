"""One worker process started before the daemon's own imports, for the first model to take.

A worker spends about 1.2 s importing mlx, mlx-lm and transformers before it reads its spec
(worker/host.py); the daemon spends about 0.5 s importing its API and config schema before it
asks for its first model. Started one after the other, a cached Llama-3.1-8B came up in 2.9 s
against llama-server's 2.7 s. Spawned first, the worker's imports run beside the daemon's on
another core, and the first model (eager, or the first lazy one asked for) skips them.

A spare is what `python -m mlxd.worker --fd N` is before it is given a model, so taking it
changes nothing else: the same command, environment and session as a worker spawned later. It
is spawned with `subprocess` (there is no event loop yet) and adopted by the loop when taken
(`SpareProcess`). One not taken (only lazy models, none asked for yet) waits for its spec at no
CPU and about 100 MiB of memory; it is killed when the daemon ends, or at once where no model
of the config could take it (models inline, every model distributed, none declared).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import subprocess
import sys
from typing import Any

from mlxd.process_exit import before_exit

log = logging.getLogger("mlxd.worker")

_spare: tuple[subprocess.Popen[bytes], socket.socket] | None = None


def worker_command(fd: int) -> list[str]:
    """A worker on the inherited socket `fd`."""
    return [sys.executable, "-m", "mlxd.worker", "--fd", str(fd)]


def spawn_options(fd: int) -> dict[str, Any]:
    """How every worker is spawned (`subprocess.Popen` or asyncio's): the socket `fd` passed
    on, no stdin, and a session of its own: a terminal's Ctrl-C reaches the daemon, which
    drains and then closes its workers; they never die under requests still finishing."""
    return {"pass_fds": (fd,), "stdin": subprocess.DEVNULL, "start_new_session": True}


class SpareProcess:
    """A spare's process as the daemon uses a worker's `asyncio.subprocess.Process`."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    def kill(self) -> None:
        self._popen.kill()

    async def wait(self) -> int:
        # A thread per waited child, as asyncio's own ThreadedChildWatcher does.
        return await asyncio.to_thread(self._popen.wait)


def start() -> None:
    """Spawn the spare (call once, before the slow imports)."""
    global _spare
    parent, child = socket.socketpair()
    with child:
        popen = subprocess.Popen(worker_command(child.fileno()), **spawn_options(child.fileno()))
    _spare = popen, parent
    before_exit(discard)
    log.debug("worker pid %d started ahead of the first model", popen.pid)


def take() -> tuple[SpareProcess, socket.socket] | None:
    """The spare and the daemon's end of its socket, once; None when there is none alive."""
    global _spare
    if _spare is None:
        return None
    popen, parent = _spare
    _spare = None
    if popen.poll() is not None:
        log.warning("the worker started ahead of the first model exited with %s", popen.returncode)
        parent.close()
        return None
    log.info("worker pid %d (started ahead of the first model) takes a model", popen.pid)
    return SpareProcess(popen), parent


def discard() -> None:
    """Kill a spare no model took."""
    global _spare
    if _spare is None:
        return
    popen, parent = _spare
    _spare = None
    parent.close()
    with contextlib.suppress(ProcessLookupError):
        popen.kill()
    popen.wait()
