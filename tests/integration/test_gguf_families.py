"""GGUFs of other families than SmolLM2's llama, served by the real daemon: a tiny random Qwen3 in
Q4_K, a tiny Gemma 3 in Q8_0 and a tiny Qwen3-MoE in Q4_0 (its experts on the kernels' gather
matmul), written as llama.cpp writes them. At temperature 0 the daemon answers what mlx-lm
itself generates from the equivalent safetensors directory."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import openai
import pytest
from gguf import GGMLQuantizationType as Q
from mlx_lm import generate, load
from mlx_lm.sample_utils import make_sampler

from mlxd.models.gguf import inspect_gguf
from mlxd.models.sources import resolve_source
from tests.integration.daemon import Daemon, start_daemon
from tests.tiny_gguf import gpt2_vocab, save_mlx_dir, tiny_config, tiny_weights, write_gguf

pytestmark = pytest.mark.integration

CHATML = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
)
FAMILIES = {
    "qwen3": ("qwen3", Q.Q4_K),
    "gemma": ("gemma3_text", Q.Q8_0),
    "moe": ("qwen3_moe", Q.Q4_0),
}
ASK = [{"role": "user", "content": "hello there"}]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path) -> dict[str, Any]:
    """name → (GGUF path, reference directory with the converted tokenizer files)."""
    made = {}
    for name, (model_type, qtype) in FAMILIES.items():
        workdir = tmp_path_factory.mktemp(name)
        # Super-blocks of 256 values per row for the K-quants.
        config = tiny_config(model_type, hidden_size=256, intermediate_size=512)
        vocab = {**gpt2_vocab(), "pre": "qwen2", "extra": {"chat_template": CHATML}}
        held = write_gguf(workdir / f"{name}.gguf", config, tiny_weights(config), qtype, vocab)
        assert inspect_gguf(workdir / f"{name}.gguf") == []
        reference = save_mlx_dir(workdir / "reference", config, held)
        converted = resolve_source(
            str(workdir / f"{name}.gguf"), model_name=name, cache_dir=mlxd_cache_dir
        )
        for tokenizer_file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(converted / tokenizer_file, reference)
        made[name] = (workdir / f"{name}.gguf", reference)
    return made


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path, models: dict[str, Any]):
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir)},
        "models": {
            name: {"source": str(gguf_path), "defaults": {"temperature": 0.0}}
            for name, (gguf_path, _) in models.items()
        },
    }
    running = start_daemon(tmp_path_factory.mktemp("gguf-families"), config)
    yield running
    running.stop()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_answers_as_mlx_lm_does(daemon: Daemon, models: dict[str, Any], name: str) -> None:
    client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(
        model=name, messages=ASK, max_tokens=MAX_TOKENS, temperature=0
    )
    model, tokenizer = load(str(models[name][1]))
    prompt = tokenizer.apply_chat_template(ASK, add_generation_prompt=True)
    expected = generate(
        model, tokenizer, prompt, max_tokens=MAX_TOKENS, sampler=make_sampler(temp=0.0)
    )
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    assert reply.choices[0].message.content == expected


def test_the_experts_run_packed_and_status_says_so(daemon: Daemon) -> None:
    from mlxd import kernels

    if not kernels.available():
        pytest.fail("mlxd's CPU kernels did not build: python -m mlxd.kernels.build")
    client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="x", max_retries=0)
    client.chat.completions.create(model="moe", messages=ASK, max_tokens=1)  # loaded by now
    row = daemon.status()["models"]["moe"]
    layers = tiny_config("qwen3_moe")["num_hidden_layers"]
    assert row["experts"] == (
        f"{3 * layers} quantized expert layers run packed on the kernels' gather matmul"
    )
