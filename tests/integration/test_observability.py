"""Observability end to end: /metrics, /v1/status, request ids and the per-request log line."""

from __future__ import annotations

import json
import time
from pathlib import Path

import anthropic
import httpx
import openai
import psutil
import pytest
from openapi_spec_validator import validate
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir)},
        "models": {
            "smol": {
                "source": SMOL_GGUF,
                "aliases": ["default"],
                "context_length": 256,
                "defaults": {"max_tokens": 8, "temperature": 0.0},
            },
            "later": {"source": SMOL_GGUF, "load": "lazy"},
        },
    }
    running = start_daemon(
        tmp_path_factory.mktemp("observability"), config, env={"MLXD_LOG_FORMAT": "json"}
    )
    yield running
    running.stop()


def samples(daemon: Daemon) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics keyed by (name, labels)."""
    response = httpx.get(f"{daemon.url}/metrics", timeout=10)
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def request_lines(daemon: Daemon) -> list[dict]:
    lines = [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]
    return [line for line in lines if line["logger"] == "mlxd.access"]


def test_metrics_count_requests_tokens_and_latency(daemon: Daemon):
    client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="x", max_retries=0)
    before = samples(daemon)
    reply = client.chat.completions.create(model="default", messages=HELLO)
    list(client.chat.completions.create(model="smol", messages=HELLO, stream=True))
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=HELLO)
    after = samples(daemon)

    def delta(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return after.get(key, 0) - before.get(key, 0)

    ok = {"model": "smol", "endpoint": "/v1/chat/completions", "status": "200"}
    assert delta("mlxd_requests_total", **ok) == 2
    missing = {"model": "", "endpoint": "/v1/chat/completions", "status": "404"}
    assert delta("mlxd_requests_total", **missing) == 1
    assert delta("mlxd_completion_tokens_total", model="smol") >= reply.usage.completion_tokens
    assert delta("mlxd_prompt_tokens_total", model="smol") >= 2 * reply.usage.prompt_tokens
    assert delta("mlxd_time_to_first_token_seconds_count", model="smol") == 2
    assert delta("mlxd_time_per_output_token_seconds_count", model="smol") == 2
    # Gauges read from the engines at scrape time.
    assert after[("mlxd_queue_depth", frozenset({"model": "smol"}.items()))] == 0
    assert after[("mlxd_batch_occupancy", frozenset({"model": "smol"}.items()))] == 0
    assert after[("mlxd_model_state", frozenset({"model": "later", "state": "unloaded"}.items()))]
    assert after[("mlxd_model_memory_bytes", frozenset({"model": "smol"}.items()))] > 0
    assert after[("mlxd_model_loads_total", frozenset({"model": "smol", "outcome": "ok"}.items()))]


def test_status_shows_live_figures(daemon: Daemon):
    client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="x", max_retries=0)
    client.completions.create(model="smol", prompt="Once upon a time", max_tokens=4)
    status = daemon.status()
    smol = status["models"]["smol"]
    assert smol["state"] == "loaded"
    assert smol["aliases"] == ["default"]
    assert smol["queue_depth"] == 0 and smol["running"] == 0
    assert smol["tokens_per_s"] > 0
    assert 0 < smol["ttft_p50_s"] <= smol["ttft_p95_s"]
    assert smol["memory_bytes"] > 0
    assert "cache" in smol
    later = status["models"]["later"]
    assert later["state"] == "unloaded" and later["tokens_per_s"] == 0
    assert status["config"]["generation"] == 1
    # Uptime counts from the daemon's start: positive, and no longer than its process has lived.
    lived = time.time() - psutil.Process(daemon.process.pid).create_time()
    assert status["platform"] and 0 < status["uptime_s"] <= lived + 1
    # The daemon's own cost, before any model: no weights, no MLX.
    footprint = status["daemon"]
    assert footprint["pid"] == daemon.process.pid
    assert 0 < footprint["startup_s"] <= lived
    assert 0 < footprint["rss_bytes"] < 1 << 30
    assert f"daemon up in {footprint['startup_s']:.2f} s" in daemon.log()


def test_request_id_is_returned_logged_and_in_anthropic_errors(daemon: Daemon):
    body = {"model": "smol", "messages": HELLO, "max_tokens": 2}
    mine = httpx.post(
        f"{daemon.url}/v1/chat/completions", json=body, headers={"x-request-id": "trace-42"}
    )
    assert mine.headers["x-request-id"] == mine.headers["request-id"] == "trace-42"
    insane = httpx.post(
        f"{daemon.url}/v1/chat/completions", json=body, headers={"x-request-id": "a b\tc"}
    )
    assert insane.headers["x-request-id"].startswith("req_")

    claude = anthropic.Anthropic(base_url=daemon.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="nope", max_tokens=2, messages=HELLO)
    assert caught.value.request_id.startswith("req_")
    assert caught.value.body["request_id"] == caught.value.request_id

    lines = {line["request_id"]: line for line in request_lines(daemon)}
    line = lines["trace-42"]
    assert line["model"] == "smol" and line["endpoint"] == "/v1/chat/completions"
    assert line["status"] == 200 and line["completion_tokens"] == 2
    assert line["prompt_tokens"] > 0 and line["ttft_ms"] > 0 and line["duration_ms"] > 0
    failed = lines[caught.value.request_id]
    assert failed["status"] == 404 and failed["model"] == "nope"
    assert "model 'nope' does not exist" in failed["error"]


def test_streamed_request_is_logged_when_the_stream_ends(daemon: Daemon):
    claude = anthropic.Anthropic(base_url=daemon.url, api_key="x", max_retries=0)
    with claude.messages.stream(model="smol", max_tokens=3, messages=HELLO) as stream:
        final = stream.get_final_message()
    logged = [line for line in request_lines(daemon) if line["endpoint"] == "/v1/messages"]
    assert logged[-1]["completion_tokens"] == final.usage.output_tokens
    assert logged[-1]["status"] == 200


def test_openapi_document_is_served_and_valid(daemon: Daemon):
    document = httpx.get(f"{daemon.url}/openapi.json").json()
    validate(document)
    assert "/v1/messages" in document["paths"]


def test_json_log_format_covers_every_line(daemon: Daemon):
    lines = [line for line in daemon.log().splitlines() if line.strip()]
    assert {json.loads(line)["logger"] for line in lines} >= {"mlxd", "mlxd.access"}
    assert not any('"/health"' in line for line in lines if '"level": "info"' in line)
