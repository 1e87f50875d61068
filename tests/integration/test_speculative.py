"""Speculative decoding end to end on SmolLM2: the ngram model answers exactly as the plain one
at temperature 0 (streamed or not, with a stop string), and its acceptance shows in /v1/status
and /metrics; so does a model with SmolLM2 as its draft model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

DOCUMENT = (
    "Our shop opens at nine in the mornng and closes at six in the evening. We sell bikes, "
    "locks and lights, and we repair flat tyres while you wait."
)
EDIT = [
    {
        "role": "user",
        "content": f"Fix the spelling mistakes and give back the whole text:\n\n{DOCUMENT}",
    }
]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    model = {"source": SMOL_GGUF, "context_length": 512, "cache": {"ram": 0}}
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir)},
        "models": {
            "plain": model,
            "ngram": {**model, "speculative": {"mode": "ngram", "num_tokens": 4}},
            "drafted": {
                **model,
                "speculative": {"mode": "draft", "model": "plain", "num_tokens": 4},
            },
        },
    }
    running = start_daemon(tmp_path_factory.mktemp("speculative"), config)
    yield running
    running.stop()


def complete(daemon: Daemon, model: str, **extra: Any) -> Any:
    client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(
        model=model, messages=EDIT, temperature=0, max_tokens=48, **extra
    )


def test_ngram_answers_exactly_like_plain_decoding(daemon: Daemon) -> None:
    plain = complete(daemon, "plain").choices[0]
    drafted = complete(daemon, "ngram").choices[0]
    assert drafted.message.content == plain.message.content
    assert drafted.finish_reason == plain.finish_reason
    assert "closes at six in the evening" in plain.message.content  # copied back
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in complete(daemon, "ngram", stream=True)
        if chunk.choices
    )
    assert streamed == plain.message.content
    # A stop string inside a run of accepted drafts ends the answer where plain decoding does.
    stopped = complete(daemon, "ngram", stop=["locks"]).choices[0]
    assert stopped.finish_reason == "stop"
    assert (
        stopped.message.content
        == complete(daemon, "plain", stop=["locks"]).choices[0].message.content
    )
    assert stopped.message.content.endswith("bikes, ")


def test_acceptance_shows_in_status_and_metrics(daemon: Daemon) -> None:
    complete(daemon, "ngram")
    models = httpx.get(f"{daemon.url}/v1/status", timeout=10).json()["models"]
    assert models["plain"]["speculative"] is None
    figures = models["ngram"]["speculative"]
    assert figures["mode"] == "ngram"
    assert 0 < figures["accepted_tokens"] <= figures["draft_tokens"]
    assert figures["acceptance_rate"] == figures["accepted_tokens"] / figures["draft_tokens"]
    text = httpx.get(f"{daemon.url}/metrics", timeout=10).text
    samples = {
        (s.name, s.labels.get("model")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert (
        samples[("mlxd_speculative_accepted_tokens_total", "ngram")] >= figures["accepted_tokens"]
    )
    assert 0 < samples[("mlxd_speculative_acceptance_rate", "ngram")] <= 1
    assert ("mlxd_speculative_draft_tokens_total", "plain") not in samples


def test_a_model_drafting_with_itself_answers_like_plain_decoding(daemon: Daemon) -> None:
    plain = complete(daemon, "plain").choices[0]
    response = complete(daemon, "drafted")
    drafted = response.choices[0]
    assert drafted.message.content == plain.message.content
    assert drafted.finish_reason == plain.finish_reason
    models = httpx.get(f"{daemon.url}/v1/status", timeout=10).json()["models"]
    figures = models["drafted"]["speculative"]
    assert figures["mode"] == "draft"
    # Every step drafts (up to 4 tokens): most of the answer was drafted.
    assert figures["draft_tokens"] >= response.usage.completion_tokens // 2
    # The same weights: every draft but a float-rounding near-tie is the target's own token.
    assert figures["acceptance_rate"] >= 0.9
    # The draft's weights are counted in the target's memory.
    assert models["drafted"]["memory_bytes"] > models["plain"]["memory_bytes"]
