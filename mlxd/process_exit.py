"""How a process that ran MLX ends: without interpreter finalization.

MLX's Python bindings keep a per-thread random key (`thread_local PyKeySequence` in
mlx/python/src/random.cpp) whose destructor takes the GIL. It runs when the OS thread exits,
which is *after* `Thread.join()` has returned (join waits for the Python thread state, not for
the thread's C++ thread-local destructors). Every thread that sampled, or loaded a model (random
parameter init), holds one: the model threads, and the asyncio executor threads that ran loads
and prompt preparation. If the main thread is finalizing the interpreter at that moment, Python
3.11 answers the GIL request with `pthread_exit`, whose forced unwind through that noexcept
destructor calls `std::terminate`: "terminate called without an active exception", SIGABRT,
exit -6 after a clean drain. A three-line script (threads that call `mx.random`, joined, then
exit) aborts about half the time.

So once shutdown is over (requests drained, engines closed, model and SSD writer threads joined,
asyncio's executor shut down) there is nothing left that finalization would do for us: flush
the logs and the standard streams and end the process with `os._exit`. Any process that hosts
an engine (the daemon with `server.workers: inline`, every engine worker) must end this way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable
from typing import NoReturn

# Work to finish before the process ends (os._exit runs no atexit hooks).
_before_exit: list[Callable[[], None]] = []


def before_exit(finish: Callable[[], None]) -> None:
    """Have `exit_process` call `finish()` first (e.g. join a thread still writing a file)."""
    if finish not in _before_exit:
        _before_exit.append(finish)


def exit_process(code: int) -> NoReturn:
    """Finish what `before_exit` asked for, flush what would otherwise be flushed at exit and
    end the process with `code`."""
    for finish in _before_exit:
        finish()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        # A closed stream or a broken pipe: nothing more can be written anyway.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
