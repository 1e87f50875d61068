"""A worker process started ahead of the model it will run: the first before the daemon's own
imports, later ones while the daemon is quiet (control/spare_policy.py says when).

A worker spends about 1.2 s importing mlx, mlx-lm and transformers before it reads its spec
(worker/host.py); the daemon spends about 0.5 s importing its API and config schema before it
asks for its first model. Started one after the other, a cached Llama-3.1-8B came up in 2.9 s
against llama-server's 2.7 s. Spawned first, the worker's imports run beside the daemon's on
another core, and the first model (eager, or the first lazy one asked for) skips them. Later
loads (a lazy model's first request, a parked model's next) take the spare kept since.

A spare is what `python -m mlxd.worker --fd N` is before it is given a model, so taking it
changes nothing else: the same command, environment and session as a worker spawned later. It
is spawned with `subprocess` (the first before there is an event loop) and adopted by the loop
when taken (`SpareProcess`). One not taken waits for its spec at no CPU and about 100 MiB of
memory; it is killed when the daemon ends, or as soon as no model of the config could take it
(models inline, every model distributed or loaded, none declared).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import subprocess
import sys
import threading
from typing import Any

from mlxd.process_exit import before_exit

log = logging.getLogger("mlxd.worker")

_spare: tuple[subprocess.Popen[bytes], socket.socket] | None = None
_ended = False  # a spare exited by itself: spawn no more
REAP_S = 0.5  # how long discarding waits for the killed spare on the caller's thread


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
    """Spawn the spare (before the slow imports; later from the event loop, control/
    spare_policy.py decides when)."""
    global _spare
    parent, child = socket.socketpair()
    try:
        with child:
            popen = subprocess.Popen(
                worker_command(child.fileno()), **spawn_options(child.fileno())
            )
    except BaseException:
        parent.close()
        raise
    _spare = popen, parent
    before_exit(discard)
    log.debug("worker pid %d started ahead of its model", popen.pid)


def keep() -> None:
    """A spare alive: spawn one where there is none, unless one already ended by itself (a
    broken install or the OOM killer would end the next as well: models then spawn their
    own workers, as without a spare)."""
    global _spare
    if _spare is not None and _spare[0].poll() is not None:
        _give_up(f"exited with {_spare[0].returncode}")
        _spare[1].close()
        _spare = None
    if _spare is None and not _ended:
        try:
            start()
        except OSError as exc:  # no memory or file descriptors left to spawn it
            _give_up(f"could not be started ({exc})")


def _give_up(why: str) -> None:
    global _ended
    _ended = True
    log.warning(
        "the worker started ahead of the next model %s; workers now start with their model", why
    )


def pid() -> int | None:
    """The waiting spare's process id (None: there is none, or it has exited)."""
    return _spare[0].pid if _spare is not None and _spare[0].poll() is None else None


def take() -> tuple[SpareProcess, socket.socket] | None:
    """The spare and the daemon's end of its socket, once; None when there is none alive."""
    global _spare
    if _spare is None:
        return None
    popen, parent = _spare
    _spare = None
    if popen.poll() is not None:
        _give_up(f"exited with {popen.returncode}")
        parent.close()
        return None
    log.info("worker pid %d (started ahead of its model) takes a model", popen.pid)
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
    try:
        popen.wait(timeout=REAP_S)
    except subprocess.TimeoutExpired:  # stuck in the kernel: reaped off the event loop
        threading.Thread(target=popen.wait, name="reap-spare", daemon=True).start()
