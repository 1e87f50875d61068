"""A process that ran MLX on threads ends with its own exit code, never SIGABRT.

Without `exit_process`, the script below (threads that use `mx.random`, joined, then a normal
interpreter exit) aborts with "terminate called without an active exception" in about half the
runs on the project's machines: see mlxd/process_exit.py.
"""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import threading
import mlx.core as mx
from mlxd.process_exit import exit_process

def sample():
    mx.eval(mx.random.uniform(shape=(4,)))  # gives this thread MLX's thread-local random key

threads = [threading.Thread(target=sample) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print("done", flush=True)
exit_process(3)
"""


def test_threads_that_used_mlx_never_abort_the_exit():
    for _ in range(10):
        result = subprocess.run(
            [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
        )
        assert (result.returncode, result.stdout) == (3, "done\n"), result.stderr
        assert "terminate called" not in result.stderr
