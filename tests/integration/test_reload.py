"""Hot reload with real weights: the YAML changes under load and nothing is dropped."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

ASK = [{"role": "user", "content": "Say hello."}]


def smol(**overrides: Any) -> dict[str, Any]:
    return {
        "source": SMOL_GGUF,
        "context_length": 512,
        "cache": {"ram": "64MiB"},
        "batch": {"max_batch_size": 8},
        "defaults": {"max_tokens": 8, "temperature": 0.0},
        **overrides,
    }


def write(daemon: Daemon, config: dict[str, Any], *, atomic: bool = True) -> float:
    """Write the config as an editor would (temp file + rename) or in place; returns when."""
    text = yaml.safe_dump({**config, "server": daemon.config["server"]})
    if atomic:
        temp = daemon.config_path.with_suffix(".tmp")
        temp.write_text(text)
        os.replace(temp, daemon.config_path)
    else:
        daemon.config_path.write_text(text)
    return time.monotonic()


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05) -> float:
    """Poll until `predicate()` is truthy; returns the time it became so."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


def model_ids(daemon: Daemon) -> set[str]:
    return {m["id"] for m in httpx.get(f"{daemon.url}/v1/models", timeout=10).json()["data"]}


def models_status(daemon: Daemon) -> dict[str, Any]:
    return daemon.status()["models"]


@pytest.fixture
def daemon(tmp_path: Path, mlxd_cache_dir: Path):
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir), "drain_timeout": "60s"},
        "models": {"smol": smol(aliases=["default"])},
    }
    running = start_daemon(tmp_path, config)
    yield running
    running.stop()


class Load:
    """8 clients streaming continuously; every request must finish cleanly."""

    def __init__(self, url: str, clients: int = 8):
        self.url, self.clients = url, clients
        self.sent = self.failed = 0
        self.errors: list[str] = []
        self._stop = asyncio.Event()

    async def _client(self, i: int) -> None:
        client = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0)
        model = ("smol", "default")[i % 2]
        while not self._stop.is_set():
            self.sent += 1
            try:
                stream = await client.chat.completions.create(
                    model=model, messages=ASK, max_tokens=12, stream=True
                )
                text, finish = "", None
                async for chunk in stream:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                assert finish in ("stop", "length") and text, (finish, text)
            except Exception as exc:  # counted, not raised: the test reports them all
                self.failed += 1
                self.errors.append(f"{model}: {type(exc).__name__}: {exc}")

    async def run(self, body) -> None:
        tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]
        try:
            await asyncio.to_thread(body)
        finally:
            self._stop.set()
            await asyncio.gather(*tasks)


def test_twenty_reloads_under_load_drop_nothing(daemon: Daemon):
    base = {"smol": smol(aliases=["default"])}
    timings: dict[str, list[float]] = {"retarget": [], "swap": []}

    def retarget(models: dict, alias: str) -> None:
        written = write(daemon, {"models": models})
        timings["retarget"].append(wait_for(lambda: alias in model_ids(daemon)) - written)

    def swap(models: dict, batch: int) -> None:
        written = write(daemon, {"models": models})
        live = wait_for(
            lambda: models_status(daemon)["smol"].get("max_batch_size") == batch, timeout=120
        )
        timings["swap"].append(live - written)

    def edits() -> None:
        models = copy.deepcopy(base)
        for i in range(4):  # 4 alias additions (retarget)
            models["smol"]["aliases"].append(f"alias-{i}")
            retarget(models, f"alias-{i}")
        models["smol"]["defaults"]["temperature"] = 0.5  # defaults change (retarget)
        write(daemon, {"models": models}, atomic=False)
        time.sleep(0.5)
        models["second"] = smol(aliases=["moving"])  # add a model
        write(daemon, {"models": models})
        wait_for(lambda: models_status(daemon).get("second", {}).get("state") == "loaded", 120)
        for i in range(3):  # move an alias back and forth between the two models
            models["second"]["aliases"] = []
            models["smol"]["aliases"].append("moving")
            write(daemon, {"models": models})
            wait_for(lambda: httpx.get(f"{daemon.url}/v1/models/moving").json()["root"] == "smol")
            models["smol"]["aliases"].remove("moving")
            models["second"]["aliases"] = ["moving"]
            write(daemon, {"models": models}, atomic=i % 2 == 0)
            wait_for(lambda: httpx.get(f"{daemon.url}/v1/models/moving").json()["root"] == "second")
        for batch in (6, 8):  # engine-level change: blue/green swap while streams run
            models["smol"]["batch"]["max_batch_size"] = batch
            swap(models, batch)
        del models["second"]  # remove a model
        write(daemon, {"models": models})
        wait_for(lambda: "second" not in models_status(daemon), timeout=90)
        assert (
            httpx.post(
                f"{daemon.url}/v1/chat/completions", json={"model": "second", "messages": ASK}
            ).status_code
            == 404
        )
        for i in range(4):
            models["smol"]["aliases"].remove(f"alias-{i}")
            write(daemon, {"models": models})
            wait_for(lambda i=i: f"alias-{i}" not in model_ids(daemon))
        models["smol"]["defaults"]["temperature"] = 0.0
        write(daemon, {"models": models})
        time.sleep(1)  # let the clients run on the final config too

    load = Load(daemon.url)
    asyncio.run(load.run(edits))
    generation = httpx.get(f"{daemon.url}/health").json()["config"]["generation"]
    print(
        f"\nreload figures: {load.sent} requests, {load.failed} failed, "
        f"config generation {generation}; retarget live after "
        f"{', '.join(f'{t:.2f}s' for t in timings['retarget'])}; swap live after "
        f"{', '.join(f'{t:.2f}s' for t in timings['swap'])}"
    )
    assert load.failed == 0, load.errors[:5]
    assert load.sent >= 2 * load.clients  # every client kept going across the reloads
    assert generation == 21  # the initial config + 20 writes, each one reconciled
    assert max(timings["retarget"]) < 2.0
    assert "model 'smol' swapped" in daemon.log()


def test_broken_yaml_keeps_serving_and_recovers(daemon: Daemon):
    client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="x", max_retries=0)
    daemon.config_path.write_text("models:\n  smol:\n    source: [unclosed\n")
    wait_for(lambda: httpx.get(f"{daemon.url}/health").json()["config"]["last_error"])
    health = httpx.get(f"{daemon.url}/health").json()
    assert health["status"] == "degraded"
    assert "models.yaml:4: YAML syntax error" in health["config"]["last_error"]
    assert client.chat.completions.create(model="smol", messages=ASK).choices[0].message.content

    write(daemon, {"models": {"smol": smol(aliases=["default", "fixed"])}})
    wait_for(lambda: "fixed" in model_ids(daemon))
    health = httpx.get(f"{daemon.url}/health").json()
    assert health["status"] == "ok" and health["config"]["last_error"] is None


def test_invalid_config_through_admin_reload_is_400(daemon: Daemon):
    before = httpx.get(f"{daemon.url}/health").json()["config"]["generation"]
    daemon.config_path.write_text("models:\n  smol:\n    sourze: x\n")
    response = httpx.post(f"{daemon.url}/admin/reload", timeout=30)
    assert response.status_code == 400
    assert "did you mean 'source'" in response.json()["error"]["message"]
    assert httpx.get(f"{daemon.url}/health").json()["config"]["generation"] == before
    assert "smol" in model_ids(daemon)


def test_sighup_reloads(daemon: Daemon):
    config = {"models": {"smol": smol(aliases=["default", "after-hup"])}}
    # Write outside the watched name first, so only the signal can trigger the reload.
    staged = daemon.config_path.with_name("staged.yaml")
    staged.write_text(
        yaml.safe_dump(
            {**config, "server": yaml.safe_load(daemon.config_path.read_text())["server"]}
        )
    )
    os.replace(staged, daemon.config_path)
    daemon.process.send_signal(signal.SIGHUP)
    wait_for(lambda: "after-hup" in model_ids(daemon))
    assert "SIGHUP: reloading" in daemon.log()


def test_lazy_model_loads_once_on_first_use_and_unloads_when_idle(tmp_path, mlxd_cache_dir):
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir)},
        "models": {"lazy": smol(load="lazy", idle_ttl="3s")},
    }
    daemon = start_daemon(tmp_path, config)
    try:
        assert models_status(daemon)["lazy"]["state"] == "unloaded"
        assert {
            m["id"]: m["state"] for m in httpx.get(f"{daemon.url}/v1/models").json()["data"]
        } == {"lazy": "unloaded"}

        async def first_requests() -> list[str]:
            client = openai.AsyncOpenAI(base_url=f"{daemon.url}/v1", api_key="x", max_retries=0)
            replies = await asyncio.gather(
                *(client.chat.completions.create(model="lazy", messages=ASK) for _ in range(4))
            )
            return [r.choices[0].message.content for r in replies]

        assert all(asyncio.run(first_requests()))
        assert daemon.log().count("model 'lazy' loaded") == 1
        wait_for(lambda: models_status(daemon)["lazy"]["state"] == "unloaded", timeout=30)
        assert "idle for 3s: unloading" in daemon.log()
        # And it comes back on the next request.
        response = httpx.post(
            f"{daemon.url}/v1/chat/completions",
            json={"model": "lazy", "messages": ASK},
            timeout=120,
        )
        assert response.status_code == 200
    finally:
        daemon.stop()


def test_memory_budget_evicts_idle_models_and_refuses_what_cannot_fit(tmp_path, mlxd_cache_dir):
    # Each model: 128 MiB of packed 4/8-bit weights + KV for 8 x 512 tokens (180 MiB; 90 MiB
    # for b's 4) + a 64 MiB prefix cache ≈ 370 MiB; two do not fit, 'huge' never does. KV in
    # float32 on every CPU (float16's `auto` depends on the kernels' ISA variant).
    f32 = {"kv_dtype": "float32"}
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir), "memory_budget": "450MiB"},
        "models": {
            "a": smol(load="lazy", cache={"ram": "64MiB", **f32}),
            "b": smol(load="lazy", batch={"max_batch_size": 4}, cache={"ram": "64MiB", **f32}),
            "huge": smol(load="lazy", cache={"ram": "1GiB", **f32}),
        },
    }
    daemon = start_daemon(tmp_path, config)
    try:

        def ask(model: str) -> httpx.Response:
            body = {"model": model, "messages": ASK}
            return httpx.post(f"{daemon.url}/v1/chat/completions", json=body, timeout=120)

        assert ask("a").status_code == 200
        assert ask("b").status_code == 200  # 'a' is idle: unloaded to make room
        states = {name: row["state"] for name, row in models_status(daemon).items()}
        assert states == {"a": "unloaded", "b": "loaded", "huge": "unloaded"}
        assert "unloading idle model 'a'" in daemon.log()

        refused = ask("huge")
        assert refused.status_code == 503
        message = refused.json()["error"]["message"]
        assert "server.memory_budget is 0.44 GiB" in message
        assert "KV (8 sequences x 512 tokens, float32)" in message
        assert "1.00 GiB prefix cache" in message
        assert ask("a").status_code == 200  # the daemon is fine and still serves
    finally:
        daemon.stop()
