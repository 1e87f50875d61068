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
            },
            # The same weights with x as one int8 term in the integer dot products.
            "smol-int8": {
                "source": SMOL_GGUF,
                "context_length": 256,
                "batch": {"prefill_step_size": 128},
                "cpu_activations": "int8",
            },
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
    leaves = "one-row kernels leave a core to the engine" in cpu_path["summary"]
    assert cpu_path["spares_a_core"] == leaves
    # The one log line says the same.
    assert f"model 'smol': {cpu_path['summary']}" in daemon.log()
    cache_dir = Path(daemon.config["server"]["cache_dir"])
    # Cached for the next load, unless timed on a busy machine or one whose pace moved (which
    # the summary says); the other model (smol-int8) keeps its own.
    other = daemon.status()["models"]["smol-int8"]["cpu_path"]
    kept = int(cpu_path["kept"]) + int(other["kept"])
    assert len(list((cache_dir / "cpu-paths").glob("*.json"))) == kept
    note = cpu_path["timing_note"]
    assert cpu_path["kept"] or (note.endswith("not cached") and note in cpu_path["summary"])
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
    header, *lines = result.stdout.splitlines()
    row = next(line for line in lines if line.split()[0] == "smol")
    assert row.split()[header.split().index("PATH")] == cpu_path["plan"]
    assert f"smol: {cpu_path['summary']}" in lines


def test_a_second_load_reuses_the_cached_timings(daemon: Daemon):
    first = daemon.status()["models"]["smol"]["cpu_path"]
    assert mlxd("unload", "smol", "--url", daemon.url).returncode == 0
    assert mlxd("load", "smol", "--url", daemon.url).returncode == 0
    again = daemon.status()["models"]["smol"]["cpu_path"]
    # Timed again where the first were not kept, or were taken at a slower pace than now.
    retimed = again["timing_note"].startswith("timed again: ")
    assert again["cached"] == (first["kept"] and not retimed)
    if again["cached"]:
        assert again["plan"] == first["plan"] and again["phases"] == first["phases"]


def test_int8_activations_are_timed_and_shown_and_answer_as_the_precise_model(daemon: Daemon):
    from mlxd import kernels

    models = daemon.status()["models"]
    precise, one_term = models["smol"]["cpu_path"], models["smol-int8"]["cpu_path"]
    assert precise["activations"] in ("precise", None)  # None: the float layout timed faster
    assert one_term["activations"] in ("int8", None)
    if one_term["activations"] == "int8":
        assert one_term["dot"] or one_term["head_dot"]
        assert "x as one int8 term" in one_term["summary"]
    if not kernels.integer_dot():  # nothing to time the int8 layout on
        assert one_term["activations"] is None
    answers = [
        httpx.post(
            f"{daemon.url}/v1/completions",
            # Greedy on both: smol-int8 has no default temperature of its own.
            json={
                "model": model,
                "prompt": "The capital of France is",
                "max_tokens": 1,
                "temperature": 0,
            },
            timeout=120,
        ).json()["choices"][0]["text"]
        for model in ("smol", "smol-int8")
    ]
    assert answers[0] and answers[0] == answers[1]
