"""`mlxd ps`, `mlxd reload` and `mlxd bench` against a real daemon, run as a user would."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir)},
        "models": {
            "smol": {
                "source": SMOL_GGUF,
                "aliases": ["default", "gpt-4o-mini"],
                "context_length": 256,
                "defaults": {"max_tokens": 4, "temperature": 0.0},
            },
            "spare": {"source": SMOL_GGUF, "load": "lazy"},
        },
    }
    running = start_daemon(tmp_path_factory.mktemp("cli"), config)
    yield running
    running.stop()


def mlxd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlxd", *args], capture_output=True, text=True, timeout=300
    )


def test_ps_lists_models_as_a_table(daemon: Daemon):
    # The lazy model has a worker imported for it once the daemon is quiet (spare_policy.py).
    deadline = time.monotonic() + 120
    while (spare := daemon.spare_pid()) is None:
        assert time.monotonic() < deadline, "no worker was made ready for the lazy model"
        time.sleep(0.2)
    result = mlxd("ps", "--url", daemon.url)
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split() == [
        "NAME",
        "KIND",
        "STATE",
        "ALIASES",
        "PID",
        "RSS",
        "ESTIMATE",
        "MLX",
        "PATH",
        "QUEUE",
        "RUNNING",
        "TOK/S",
    ]
    table = {row.split()[0]: row.split() for row in rows}
    assert table["smol"][1:4] == ["llm", "loaded", "default,gpt-4o-mini"]
    # Its own worker process, with its resident memory next to the estimate.
    assert int(table["smol"][4]) == daemon.status()["models"]["smol"]["pid"]
    assert table["smol"][5].endswith("MiB") and int(table["smol"][5][:-3]) > 0
    assert table["smol"][6].endswith("MiB") and int(table["smol"][6][:-3]) > 0
    # What MLX's allocator holds: ≈0 for a cached load, whose weights are the packed file's
    # mapped pages (models/packed_cache.py), until requests allocate KV.
    mlx = daemon.status()["models"]["smol"]["mlx_active_bytes"]
    assert table["smol"][7] == (f"{mlx / 2**20:.0f}MiB" if mlx else "-")
    # The CPU path its load chose (models/cpu_path.py), one line of figures under the table.
    assert table["smol"][8] == daemon.status()["models"]["smol"]["cpu_path"]["plan"]
    assert table["spare"][1:9] == ["llm", "unloaded", "-", "-", "-", "-", "-", "-"]
    assert f"worker pid {spare} (" in result.stdout
    assert "MiB) waits for the next load" in result.stdout


def test_ps_reports_an_unreachable_daemon(daemon: Daemon):
    result = mlxd("ps", "--url", "http://127.0.0.1:9")
    assert result.returncode == 1
    assert "cannot reach mlxd at http://127.0.0.1:9" in result.stderr


def test_reload_prints_the_outcome(daemon: Daemon):
    config = dict(daemon.config)
    config["models"] = {**config["models"], "smol": {**config["models"]["smol"], "aliases": ["x"]}}
    daemon.config_path.write_text(yaml.safe_dump(config))
    result = mlxd("reload", "--url", daemon.url)
    assert result.returncode == 0, result.stderr
    # The file watcher may have applied the change first; then there is nothing left to do.
    generation = daemon.status()["config"]["generation"]
    assert result.stdout.startswith(f"config generation {generation}:\n  ")
    assert "retarget 'smol': aliases" in result.stdout or "nothing to change" in result.stdout
    assert daemon.status()["models"]["smol"]["aliases"] == ["x"]

    daemon.config_path.write_text("models:\n  smol:\n    sauce: nope\n")
    rejected = mlxd("reload", "--url", daemon.url)
    assert rejected.returncode == 1
    assert "HTTP 400" in rejected.stderr and "sauce" in rejected.stderr
    daemon.config_path.write_text(yaml.safe_dump(daemon.config))
    assert mlxd("reload", "--url", daemon.url).returncode == 0


def test_bench_prints_a_sweep(daemon: Daemon):
    result = mlxd(
        "bench", "--url", daemon.url, "--model", "smol",
        "--concurrency", "1,2", "--max-tokens", "3", "--requests", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + result.stdout
    lines = result.stdout.splitlines()
    assert lines[0].split()[:4] == ["conc", "reqs", "ok", "fail"]
    assert [line.split()[:4] for line in lines[1:3]] == [["1", "2", "2", "0"], ["2", "2", "2", "0"]]
    # Completion tokens an answered request: a server that stops early shows here.
    assert lines[0].split()[5] == "tok/req"
    assert all(0 < float(line.split()[5]) <= 3 for line in lines[1:3])


def states(daemon: Daemon) -> dict[str, str]:
    return {name: row["state"] for name, row in daemon.status()["models"].items()}


def test_load_and_unload_on_demand_go_through_the_reconciler(daemon: Daemon):
    loaded = mlxd("load", "spare", "--url", daemon.url)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "spare: loaded"
    unloaded = mlxd("unload", "default", "--url", daemon.url)  # an alias names its model
    assert unloaded.stdout.strip() == "smol: unloaded", unloaded.stderr
    assert states(daemon) == {"smol": "unloaded", "spare": "loaded"}
    # An eager model unloaded on demand stays unloaded through a reconcile …
    assert mlxd("reload", "--url", daemon.url).returncode == 0
    assert states(daemon)["smol"] == "unloaded"
    assert "model 'smol' unloaded on demand" in daemon.log()
    # … until its next request loads it again; the YAML file was not touched.
    reply = httpx.post(
        f"{daemon.url}/v1/chat/completions",
        json={"model": "smol", "messages": [{"role": "user", "content": "Hi"}]},
        timeout=120,
    )
    assert reply.status_code == 200
    assert states(daemon)["smol"] == "loaded"
    missing = mlxd("unload", "nope", "--url", daemon.url)
    assert missing.returncode == 1
    assert "HTTP 404" in missing.stderr and "does not exist" in missing.stderr


@pytest.mark.parametrize("command", ["serve", "check", "ps", "reload", "load", "unload", "bench"])
def test_every_command_explains_itself(command: str):
    result = mlxd(command, "--help")
    assert result.returncode == 0
    assert result.stdout.startswith(f"usage: mlxd {command}")
    assert len(result.stdout.split("\n\n")[1]) > 40  # a description, not just the usage line
