"""SIGTERM ends the daemon with exit code 0, every time: after its model thread died and was
restarted, while that restart is still loading, and with SSD cache writes queued.

Each of these used to end, now and then, in "terminate called without an active exception"
(SIGABRT, exit -6) after a clean drain: see mlxd/process_exit.py for the cause.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.daemon import FAULT_HOOKS, SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

KILL_THREAD = "FAULT-THREAD-3"
BLOCK = 24  # tokens per cache block: a size no other test uses, so these SSD files are ours
LONG_PROMPT = "Tell me about the history of bicycles, trains and boats. " * 12


def chat(daemon: Daemon, text: str) -> None:
    client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0)
    client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": text}], max_tokens=4
    )


def kill_model_thread(daemon: Daemon) -> None:
    with pytest.raises(openai.InternalServerError, match="engine thread died"):
        chat(daemon, f"{KILL_THREAD} count to 100")
    deadline = time.monotonic() + 60
    while daemon.status()["models"]["smol"]["restarts"] < 1:
        assert time.monotonic() < deadline, "the dead model thread was never restarted"
        time.sleep(0.1)


def wait_until_loaded(daemon: Daemon) -> None:
    deadline = time.monotonic() + 180
    while httpx.get(f"{daemon.url}/health", timeout=10).json()["models"]["smol"] != "loaded":
        assert time.monotonic() < deadline, "the restarted model never loaded"
        time.sleep(0.2)


@pytest.mark.parametrize("round_", range(3))
def test_sigterm_exits_zero(round_: int, tmp_path: Path, mlxd_cache_dir: Path) -> None:
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir)},
        "models": {
            "smol": {
                "source": SMOL_GGUF,
                "cache": {"ram": "64MiB", "ssd": "256MiB", "block_size": BLOCK},
                "defaults": {"temperature": 0.7},  # sampling: MLX's per-thread random key
            }
        },
    }
    daemon = start_daemon(
        tmp_path, config, env={"MLXD_FAULT_INJECT": f"thread:{KILL_THREAD}", **FAULT_HOOKS}
    )
    try:
        kill_model_thread(daemon)
        if round_ % 2 == 0:  # stop a restarted engine just after it queued SSD writes
            wait_until_loaded(daemon)
            chat(daemon, f"{round_} {LONG_PROMPT}")
        # odd rounds: stop while the restart is (most likely) still loading
    finally:
        code = daemon.stop()
    log = daemon.log()
    assert code == 0, log[-3000:]
    assert "terminate called" not in log
    if round_ % 2 == 0:  # the queued writes finished before the exit: whole files, no temps
        blocks = list(mlxd_cache_dir.glob("kv/*/*.safetensors"))
        assert blocks and not [path for path in blocks if ".tmp" in path.name]
