"""A load error that will recur (an unsupported or missing file) marks the model failed with its
reason and is not retried on a backoff; changing the file or reloading the YAML tries again.
Real daemon, real CLI."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.gguf_files import write_gguf
from tests.integration.daemon import SMOL_GGUF, start_daemon

pytestmark = pytest.mark.integration

NOT_RETRIED = "not retried until its source files or the config change"


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


def test_a_load_error_that_recurs_is_not_retried_until_something_changes(
    tmp_path: Path, mlxd_cache_dir: Path
):
    write_gguf(tmp_path / "mamba.gguf", arch="mamba")
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir)},
        "models": {
            "snake": {"source": str(tmp_path / "mamba.gguf")},
            "gone": {"source": str(tmp_path / "later.gguf")},
        },
    }
    daemon = start_daemon(tmp_path, config)
    try:

        def rows() -> dict:
            return daemon.status()["models"]

        wait_for(lambda: all(row["state"] == "failed" for row in rows().values()))
        time.sleep(8)  # a backoff would have retried after 1, 2 and 4 s
        snake, gone = rows()["snake"], rows()["gone"]
        assert "architecture 'mamba'" in snake["error"] and "does not exist" in gone["error"]
        for row in (snake, gone):
            assert row["failures"] == 1 and row["gave_up"] and row["next_retry_s"] is None
        assert daemon.log().count("model 'snake' failed to load") == 1
        assert f"({NOT_RETRIED})" in daemon.log()

        ps = subprocess.run(
            [sys.executable, "-m", "mlxd", "ps", "--url", daemon.url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ps.returncode == 0, ps.stderr
        assert "snake: model 'snake': " in ps.stdout and NOT_RETRIED in ps.stdout, ps.stdout

        # A request gets the reason at once, and does not load the file again.
        answer = httpx.post(
            f"{daemon.url}/v1/chat/completions",
            json={"model": "snake", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert answer.status_code == 503
        assert "architecture 'mamba'" in answer.json()["error"]["message"]
        assert "retry-after" not in answer.headers
        assert rows()["snake"]["failures"] == 1

        # The missing file appears: the model is tried again (and now fails on its contents).
        write_gguf(tmp_path / "later.gguf", arch="mamba")
        wait_for(lambda: rows()["gone"]["failures"] == 2)
        assert "architecture 'mamba'" in rows()["gone"]["error"]

        # A reload of the YAML tries the failed models again.
        assert httpx.post(f"{daemon.url}/admin/reload", timeout=30).status_code == 200
        wait_for(lambda: rows()["snake"]["failures"] == 2)
        assert rows()["snake"]["gave_up"]
    finally:
        assert daemon.stop() == 0


def test_a_model_over_the_budget_is_refused_with_its_numbers_before_it_is_read(tmp_path: Path):
    cache_dir = tmp_path / "cache"  # nothing converted yet: a conversion would read the file
    config = {
        "server": {"cache_dir": str(cache_dir), "memory_budget": "300MiB"},
        # KV in float16, as `auto` takes it on a CPU whose kernels widen halves in hardware.
        "models": {"big": {"source": SMOL_GGUF, "cache": {"ram": "1GiB", "kv_dtype": "float16"}}},
    }
    daemon = start_daemon(tmp_path, config)
    try:
        wait_for(lambda: daemon.status()["models"]["big"]["state"] == "failed")
        row = daemon.status()["models"]["big"]
        assert row["gave_up"], row
        # The model's own context (8192) for 32 sequences: the numbers, then what to change.
        assert (
            "0.09 GiB weights + 5.62 GiB KV (32 sequences x 8192 tokens, float16) + "
            in (row["error"])
        )
        assert "1.00 GiB prefix cache (cache.ram)" in row["error"]
        assert "server.memory_budget is 0.29 GiB: lower batch.max_batch_size" in row["error"]
        assert not (cache_dir / "gguf").exists()  # refused from the header alone
    finally:
        assert daemon.stop() == 0


def test_a_swap_to_an_unsupported_file_keeps_the_old_engine_and_is_not_retried(
    tmp_path: Path, mlxd_cache_dir: Path
):
    write_gguf(tmp_path / "mamba.gguf", arch="mamba")
    smol = {"source": SMOL_GGUF, "context_length": 256, "batch": {"max_batch_size": 2}}
    daemon = start_daemon(
        tmp_path, {"server": {"cache_dir": str(mlxd_cache_dir)}, "models": {"smol": smol}}
    )
    try:
        pid = daemon.status()["models"]["smol"]["pid"]
        config = {**daemon.config, "models": {"smol": {**smol, "source": "mamba.gguf"}}}
        daemon.config_path.write_text(yaml.safe_dump(config))
        assert httpx.post(f"{daemon.url}/admin/reload", timeout=30).status_code == 200
        wait_for(lambda: daemon.status()["models"]["smol"]["error"] is not None)
        time.sleep(5)  # a swap retried every tick would have failed again by now
        row = daemon.status()["models"]["smol"]
        assert row["state"] == "loaded" and row["pid"] == pid and row["gave_up"]
        assert row["failures"] == 1 and "architecture 'mamba'" in row["error"]
        answer = httpx.post(
            f"{daemon.url}/v1/chat/completions",
            json={
                "model": "smol",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
            timeout=60,
        )
        assert answer.status_code == 200  # the old engine keeps serving
    finally:
        assert daemon.stop() == 0
