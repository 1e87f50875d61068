"""The CPU path a quantized model runs (issue 25): timed at its first load, cached for the
next, and reported in /v1/status, `mlxd ps` and the log, against the real daemon with SmolLM2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mlxd.models.cpu_path import PLANS
from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    # A cache dir of its own, so the first load times the paths; the converted GGUF is shared
    # (converting again takes minutes).
    cache_dir = tmp_path_factory.mktemp("cpu-path-cache")
    (mlxd_cache_dir / "gguf").mkdir(exist_ok=True)
    (cache_dir / "gguf").symlink_to(mlxd_cache_dir / "gguf")
    config = {
        "server": {"cache_dir": str(cache_dir)},
        "models": {
            "smol": {
                "source": SMOL_GGUF,
                "context_length": 256,
                "batch": {"prefill_step_size": 128},
                "defaults": {"max_tokens": 4, "temperature": 0.0},
            }
        },
    }
    running = start_daemon(tmp_path_factory.mktemp("cpu-path"), config, timeout=300)
    yield running
    running.stop()


def mlxd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlxd", *args], capture_output=True, text=True, timeout=300
    )


def test_the_first_load_times_both_paths_and_reports_the_choice(daemon: Daemon):
    cpu_path = daemon.status()["models"]["smol"]["cpu_path"]
    assert cpu_path["plan"] in PLANS and not cpu_path["cached"]
    phases = [p["phase"] for p in cpu_path["phases"]]
    assert phases == ["decode 1", "decode 8", "decode 32", "prefill 128"]
    for phase in cpu_path["phases"]:
        assert phase["path"] in ("packed", "float32")
        assert phase["packed_ms"] > 0 and phase["float32_ms"] > 0
    # The one log line says the same.
    assert f"model 'smol': {cpu_path['summary']}" in daemon.log()
    cache_dir = Path(daemon.config["server"]["cache_dir"])
    # Cached for the next load, unless timed on a busy machine (which the summary says).
    assert len(list((cache_dir / "cpu-paths").glob("*.json"))) == int(cpu_path["kept"])
    assert cpu_path["kept"] or "timed on a busy machine, not cached" in cpu_path["summary"]
    # The model answers on that path.
    reply = httpx.post(
        f"{daemon.url}/v1/completions",
        json={"model": "smol", "prompt": "The capital of France is", "max_tokens": 4},
        timeout=120,
    )
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"]


def test_mlxd_ps_shows_the_path_and_its_figures(daemon: Daemon):
    cpu_path = daemon.status()["models"]["smol"]["cpu_path"]
    result = mlxd("ps", "--url", daemon.url)
    assert result.returncode == 0, result.stderr
    header, row, *notes = result.stdout.splitlines()
    assert row.split()[header.split().index("PATH")] == cpu_path["plan"]
    assert f"smol: {cpu_path['summary']}" in notes


def test_a_second_load_reuses_the_cached_timings(daemon: Daemon):
    first = daemon.status()["models"]["smol"]["cpu_path"]
    assert mlxd("unload", "smol", "--url", daemon.url).returncode == 0
    assert mlxd("load", "smol", "--url", daemon.url).returncode == 0
    again = daemon.status()["models"]["smol"]["cpu_path"]
    assert again["cached"] == first["kept"]  # timed again where the first were not kept
    if again["cached"]:
        assert again["plan"] == first["plan"] and again["phases"] == first["phases"]
