"""The KV prefix cache end to end: real SmolLM2 weights at temperature 0, so a cache hit must
give exactly the answer a full prefill gives."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

SYSTEM = "You are a careful assistant for a small hardware shop. " + " ".join(
    f"Rule {i}: answer questions about item {i} briefly and politely." for i in range(30)
)
QUESTIONS = [
    "What is the capital of France?",
    "What is 2 + 2?",
    "Name a primary colour.",
    "What is the opposite of hot?",
]


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def smol(cache: dict[str, Any]) -> dict[str, Any]:
    return {
        "source": SMOL_GGUF,
        "cache": cache,
        "batch": {"max_batch_size": 8, "prefill_batch_size": 8},
        "defaults": {"max_tokens": 24, "temperature": 0.0},
    }


def ask(daemon: Daemon, model: str, question: str, max_tokens: int = 24) -> Any:
    client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(
        model=model, messages=messages(question), temperature=0, max_tokens=max_tokens
    )


def answer(daemon: Daemon, model: str, question: str) -> str:
    return ask(daemon, model, question).choices[0].message.content


def cache_stats(daemon: Daemon, model: str) -> dict[str, Any]:
    return daemon.status()["models"][model]["cache"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    workdir = tmp_path_factory.mktemp("prefix-cache")
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir)},
        "models": {
            "cached": smol({"ram": "256MiB", "block_size": 16}),
            "kv8": smol({"ram": "256MiB", "block_size": 16, "kv_bits": 8}),
            "wide": smol({"ram": "256MiB", "block_size": 16, "kv_dtype": "float32"}),
            "plain": smol({"ram": 0}),
        },
    }
    running = start_daemon(workdir, config)
    yield running
    running.stop()


def test_a_ram_hit_answers_exactly_like_a_full_prefill(daemon: Daemon) -> None:
    first = answer(daemon, "cached", QUESTIONS[0])
    before = cache_stats(daemon, "cached")
    again = ask(daemon, "cached", QUESTIONS[0])
    after = cache_stats(daemon, "cached")
    assert again.choices[0].message.content == first == answer(daemon, "plain", QUESTIONS[0])
    assert after["hits"]["ram"] == before["hits"]["ram"] + 1
    assert after["cached_tokens"] > before["cached_tokens"] + 300
    assert after["bytes"]["ram"] > 0
    # usage counts every prompt token, cached or not
    assert again.usage.prompt_tokens > after["cached_tokens"] - before["cached_tokens"]
    assert cache_stats(daemon, "plain")["bytes"]["ram"] == 0


def test_a_shared_system_prompt_hit_answers_like_a_full_prefill(daemon: Daemon) -> None:
    answer(daemon, "cached", QUESTIONS[0])  # caches the system prompt
    hits = cache_stats(daemon, "cached")["hits"]["ram"]
    assert answer(daemon, "cached", QUESTIONS[1]) == answer(daemon, "plain", QUESTIONS[1])
    assert cache_stats(daemon, "cached")["hits"]["ram"] == hits + 1


def test_quantized_kv_hit_answers_like_its_own_uncached_run(daemon: Daemon) -> None:
    """8-bit blocks are lossy: the hit's answer starts as the full prefill's. (Whole answers
    agreed with a float32 cache; from a float16 one the 8-bit prefix flips this prompt's
    greedy choice after its first line; unquantized, float16 and float32 KV gave the same 24
    tokens for each of QUESTIONS, measured; tests/unit/test_kv_dtype.py checks another.)"""
    first = answer(daemon, "kv8", QUESTIONS[2])
    before = cache_stats(daemon, "kv8")
    again = answer(daemon, "kv8", QUESTIONS[2])
    assert again.splitlines()[0] == first.splitlines()[0] == "The primary colours are:"
    after = cache_stats(daemon, "kv8")
    assert after["hits"]["ram"] == before["hits"]["ram"] + 1
    assert after["kv_bits"] == 8
    # 8-bit blocks take about half the float16 bytes of the same prefix (8 bits and a
    # float16 scale and bias per 64)
    full = cache_stats(daemon, "cached")
    per_token_8 = after["bytes"]["ram"] / (after["blocks"]["ram"] * 16)
    per_token_16 = full["bytes"]["ram"] / (full["blocks"]["ram"] * 16)
    assert per_token_8 < per_token_16 / 1.8


def test_the_kv_cache_is_float16_on_the_cpu_unless_the_yaml_says_float32(daemon: Daemon) -> None:
    """cache.kv_dtype: float16 by default (llama.cpp's f16 cache), float32 on request; the
    status says which, and a float32 prefix takes twice the bytes of the same float16 one."""
    answer(daemon, "cached", QUESTIONS[0])
    answer(daemon, "wide", QUESTIONS[0])
    models = daemon.status()["models"]
    assert models["cached"]["kv_dtype"] == models["cached"]["cache"]["kv_dtype"] == "float16"
    assert models["wide"]["kv_dtype"] == models["wide"]["cache"]["kv_dtype"] == "float32"
    half, wide = cache_stats(daemon, "cached"), cache_stats(daemon, "wide")
    per_token_16 = half["bytes"]["ram"] / (half["blocks"]["ram"] * 16)
    per_token_32 = wide["bytes"]["ram"] / (wide["blocks"]["ram"] * 16)
    assert per_token_32 == 2 * per_token_16


def test_concurrent_shared_prefix_requests_while_others_decode(daemon: Daemon) -> None:
    expected = {q: answer(daemon, "plain", q) for q in QUESTIONS}
    answer(daemon, "cached", QUESTIONS[3])  # the system prompt is cached
    with ThreadPoolExecutor(8) as pool:
        # Long decodes without the shared prefix run alongside the cache hits.
        long_runs = [
            pool.submit(
                lambda: openai.OpenAI(
                    base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0
                ).completions.create(model="cached", prompt="Once upon a time", max_tokens=96)
            )
            for _ in range(2)
        ]
        hits = [pool.submit(ask, daemon, "cached", q) for q in QUESTIONS * 2]
        replies = [f.result() for f in hits]
        longs = [f.result() for f in long_runs]
    for question, reply in zip(QUESTIONS * 2, replies, strict=True):
        assert reply.choices[0].message.content == expected[question]
    assert all(r.usage.completion_tokens == 96 for r in longs)
    assert daemon.status()["models"]["cached"]["running"] == 0


def test_restart_reads_the_ssd_tier(tmp_path: Path, mlxd_cache_dir: Path) -> None:
    # block_size 32: its own fingerprint, so no other test's blocks are in its directory.
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir)},
        "models": {"smol": smol({"ram": "256MiB", "ssd": "512MiB", "block_size": 32})},
    }
    first = start_daemon(tmp_path, config)
    try:
        before = answer(first, "smol", QUESTIONS[0])
        assert cache_stats(first, "smol")["misses"] == 1
    finally:
        assert first.stop() == 0  # a clean stop finishes the queued SSD writes
    second = start_daemon(tmp_path, config)
    try:
        stats = cache_stats(second, "smol")
        assert stats["bytes"]["ssd"] > 0 and stats["bytes"]["ram"] == 0
        assert answer(second, "smol", QUESTIONS[0]) == before
        stats = cache_stats(second, "smol")
        assert stats["hits"]["ssd"] == 1 and stats["misses"] == 0
        assert stats["cached_tokens"] > 300
    finally:
        second.stop()


def test_each_key_has_its_own_partition(tmp_path: Path, mlxd_cache_dir: Path) -> None:
    """One key's cached prompt (or a shared system prompt) is no hit for another key, so it
    cannot time which prompts others sent; its own repeats still hit."""
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir), "api_keys": ["key-a", "key-b"]},
        "models": {"smol": smol({"ram": "256MiB", "block_size": 16})},
    }
    keyed = start_daemon(tmp_path, config)

    def ask_as(key: str, question: str) -> str:
        client = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=key, max_retries=0)
        reply = client.chat.completions.create(
            model="smol", messages=messages(question), temperature=0, max_tokens=8
        )
        return reply.choices[0].message.content or ""

    def stats() -> dict[str, Any]:
        return keyed.status_with("key-a")["models"]["smol"]["cache"]

    try:
        first = ask_as("key-a", QUESTIONS[0])
        assert stats()["misses"] == 1
        assert ask_as("key-b", QUESTIONS[1])  # the same system prompt, another question
        assert stats()["hits"]["ram"] == 0 and stats()["misses"] == 2
        assert ask_as("key-a", QUESTIONS[0]) == first
        assert stats()["hits"]["ram"] == 1
        secret = mlxd_cache_dir / "cache-scope.secret"
        assert secret.stat().st_mode & 0o777 == 0o600
    finally:
        keyed.stop()
