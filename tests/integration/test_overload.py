"""Overload and faults against the real daemon: a full queue, request timeouts, SIGTERM drain,
a failing sequence and a dying engine thread."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import yaml

from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

COUNT = [{"role": "user", "content": "Count from 1 to 500, one number per line."}]
# SmolLM2's end-of-text tokens banned: the answer runs until max_tokens.
NO_EOS = {"0": -100, "1": -100, "2": -100}
FAULTS = "sequence:FAULT-SEQ-7,thread:FAULT-THREAD-9"


def smol(**overrides: Any) -> dict[str, Any]:
    return {
        "source": SMOL_GGUF,
        "context_length": 1024,
        "cache": {"ram": "64MiB"},
        "defaults": {"max_tokens": 8, "temperature": 0.0},
        **overrides,
    }


def server(cache_dir: Path, **overrides: Any) -> dict[str, Any]:
    return {"cache_dir": str(cache_dir), **overrides}


def oai(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0)


def claude(daemon: Daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0)


def chat_body(max_tokens: int, content: str = "") -> dict[str, Any]:
    messages = [{"role": "user", "content": COUNT[0]["content"] + content}]
    return {
        "model": "smol",
        "messages": messages,
        "max_tokens": max_tokens,
        "logit_bias": NO_EOS,
        "stream": True,
    }


def open_streams(stack: contextlib.ExitStack, daemon: Daemon, bodies: list[dict]) -> list:
    """Start streaming chat completions; returns their responses (headers received)."""
    client = stack.enter_context(httpx.Client(timeout=120))
    return [
        stack.enter_context(client.stream("POST", f"{daemon.url}/v1/chat/completions", json=b))
        for b in bodies
    ]


def read_stream(response: httpx.Response) -> tuple[list[dict], bool]:
    """Every data payload of an OpenAI stream, and whether it ended with [DONE]."""
    payloads, done = [], False
    for line in response.iter_lines():
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            payloads.append(json.loads(line[6:]))
    return payloads, done


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout}s")


def smol_stats(daemon: Daemon) -> dict[str, Any]:
    return daemon.status()["models"]["smol"]


def slots_free(daemon: Daemon) -> bool:
    stats = smol_stats(daemon)
    return stats["running"] == 0 and stats["waiting"] == 0


# -- a full queue and request timeouts ------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    config = {
        "server": server(mlxd_cache_dir, request_timeout="120s"),
        "models": {"smol": smol(batch={"max_batch_size": 1, "max_queue": 2})},
    }
    running = start_daemon(tmp_path_factory.mktemp("overload"), config)
    yield running
    running.stop()


def set_request_timeout(daemon: Daemon, timeout: str) -> None:
    config = {**daemon.config, "server": {**daemon.config["server"], "request_timeout": timeout}}
    temp = daemon.config_path.with_suffix(".tmp")
    temp.write_text(yaml.safe_dump(config))
    os.replace(temp, daemon.config_path)
    assert httpx.post(f"{daemon.url}/admin/reload", timeout=60).status_code == 200


def test_full_queue_is_429_or_529_with_retry_after(daemon: Daemon):
    with contextlib.ExitStack() as stack:
        open_streams(stack, daemon, [chat_body(400) for _ in range(3)])  # 1 running, 2 waiting
        wait_for(lambda: smol_stats(daemon)["waiting"] == 2)
        with pytest.raises(openai.RateLimitError) as caught:
            oai(daemon).chat.completions.create(model="smol", messages=COUNT)
        assert caught.value.response.headers["retry-after"] == "1"
        assert "max_queue" in caught.value.message
        # Anthropic's word for it: 529 overloaded_error, which its clients retry.
        with pytest.raises(anthropic.OverloadedError) as caught:
            claude(daemon).messages.create(model="smol", max_tokens=4, messages=COUNT)
        assert caught.value.status_code == 529
        assert caught.value.response.headers["retry-after"] == "1"
        assert caught.value.body["error"]["type"] == "overloaded_error"
    wait_for(lambda: slots_free(daemon))  # the closed streams gave their slots back
    assert oai(daemon).chat.completions.create(model="smol", messages=COUNT).choices


def test_request_timeout_is_408_and_frees_the_slot(daemon: Daemon):
    set_request_timeout(daemon, "2s")
    try:
        with pytest.raises(openai.APIStatusError) as caught:
            oai(daemon).chat.completions.create(
                model="smol", messages=COUNT, max_tokens=500, logit_bias=NO_EOS
            )
        assert caught.value.status_code == 408
        assert "request_timeout" in caught.value.message
        stream = oai(daemon).chat.completions.create(
            model="smol", messages=COUNT, max_tokens=500, logit_bias=NO_EOS, stream=True
        )
        with pytest.raises(openai.APIError) as caught:
            for _ in stream:
                pass
        assert "request_timeout" in caught.value.message
        # The Messages API has no logit_bias to keep the answer going: a deadline the model
        # cannot beat to its own end (≈20 tokens at the fastest machine's pace).
        set_request_timeout(daemon, "0.3s")
        with pytest.raises(anthropic.APIStatusError) as caught:
            claude(daemon).messages.create(model="smol", max_tokens=500, messages=COUNT)
        assert caught.value.status_code == 408
        assert caught.value.body["error"]["type"] == "timeout_error"
        with (
            pytest.raises(anthropic.APIError) as caught,
            claude(daemon).messages.stream(model="smol", max_tokens=500, messages=COUNT) as events,
        ):
            for _ in events:
                pass
        assert "request_timeout" in str(caught.value)
        wait_for(lambda: slots_free(daemon))
        assert smol_stats(daemon)["cancelled"] >= 4
    finally:
        set_request_timeout(daemon, "120s")
    reply = oai(daemon).chat.completions.create(model="smol", messages=COUNT)
    assert reply.choices[0].finish_reason == "length"


# -- SIGTERM ---------------------------------------------------------------------------------


@pytest.fixture
def drain_daemon(tmp_path: Path, mlxd_cache_dir: Path):
    config = {
        "server": server(mlxd_cache_dir, drain_timeout="120s"),
        "models": {"smol": smol(batch={"max_batch_size": 4})},
    }
    running = start_daemon(tmp_path, config)
    yield running
    running.stop()


def test_sigterm_finishes_open_streams_refuses_new_requests_and_exits_0(drain_daemon: Daemon):
    daemon = drain_daemon
    with contextlib.ExitStack() as stack:
        streams = open_streams(stack, daemon, [chat_body(64) for _ in range(4)])
        wait_for(lambda: smol_stats(daemon)["running"] == 4)
        daemon.process.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{daemon.url}/health").json()["status"] == "draining")
        refused = httpx.post(f"{daemon.url}/v1/chat/completions", json=chat_body(4))
        assert refused.status_code == 503
        assert refused.json()["error"]["message"] == "mlxd is shutting down"
        refused = httpx.post(
            f"{daemon.url}/v1/messages",
            json={"model": "smol", "max_tokens": 4, "messages": COUNT},
        )
        assert refused.status_code == 529  # Anthropic's status for overload
        assert refused.json()["error"]["type"] == "overloaded_error"
        for response in streams:
            payloads, done = read_stream(response)
            assert done
            assert payloads[-1]["choices"][0]["finish_reason"] == "length"
            text = "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads)
            assert text
    assert daemon.process.wait(timeout=60) == 0
    assert "every in-flight request finished" in daemon.log()


def test_second_sigterm_exits_at_once(drain_daemon: Daemon):
    daemon = drain_daemon
    with contextlib.ExitStack() as stack:
        open_streams(stack, daemon, [chat_body(1000) for _ in range(2)])
        wait_for(lambda: smol_stats(daemon)["running"] == 2)
        daemon.process.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{daemon.url}/health").json()["status"] == "draining")
        daemon.process.send_signal(signal.SIGTERM)
        # Far sooner than the streams (1000 tokens) or drain_timeout (120s) would allow.
        assert daemon.process.wait(timeout=30) == 128 + signal.SIGTERM


# -- faults ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fault_daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    config = {
        "server": server(mlxd_cache_dir),
        "models": {"smol": smol(batch={"max_batch_size": 8})},
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLXD_FAULT_INJECT", FAULTS)
        patch.setenv("MLXD_WORKER_HOOKS", "mlxd.testing.faults")
        running = start_daemon(tmp_path_factory.mktemp("faults"), config)
    yield running
    running.stop()


def test_a_failing_sequence_fails_only_its_request(fault_daemon: Daemon):
    daemon = fault_daemon
    aclient = openai.AsyncOpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0)
    aclaude = anthropic.AsyncAnthropic(base_url=daemon.url, api_key="unused", max_retries=0)

    async def good() -> tuple[str, str]:
        stream = await aclient.chat.completions.create(
            model="smol", messages=COUNT, max_tokens=32, logit_bias=NO_EOS, stream=True
        )
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def bad_stream() -> None:
        messages = [{"role": "user", "content": "FAULT-SEQ-7 count to 500"}]
        stream = await aclient.chat.completions.create(
            model="smol", messages=messages, max_tokens=32, logit_bias=NO_EOS, stream=True
        )
        async for _ in stream:
            pass

    async def bad_anthropic() -> None:
        messages = [{"role": "user", "content": "FAULT-SEQ-7 count to 500"}]
        await aclaude.messages.create(model="smol", max_tokens=32, messages=messages)

    async def main() -> list:
        return await asyncio.gather(
            good(), good(), good(), bad_stream(), bad_anthropic(), return_exceptions=True
        )

    failed_before = smol_stats(daemon)["failed"]
    *goods, stream_error, anthropic_error = asyncio.run(main())
    for text, finish in goods:
        assert finish == "length" and text
    assert isinstance(stream_error, openai.APIError)
    assert "injected fault" in stream_error.message
    assert isinstance(anthropic_error, anthropic.InternalServerError)
    assert anthropic_error.body["error"]["type"] == "api_error"
    assert "injected fault" in anthropic_error.body["error"]["message"]
    stats = smol_stats(daemon)
    assert stats["failed"] == failed_before + 2
    assert stats["state"] == "loaded" and stats["restarts"] == 0
    assert oai(daemon).chat.completions.create(model="smol", messages=COUNT).choices


def test_a_dead_engine_thread_is_reported_and_restarted(fault_daemon: Daemon):
    daemon = fault_daemon
    messages = [{"role": "user", "content": "FAULT-THREAD-9 count to 500"}]
    with pytest.raises(openai.InternalServerError) as caught:
        oai(daemon).chat.completions.create(
            model="smol", messages=messages, max_tokens=32, logit_bias=NO_EOS
        )
    assert "engine thread died" in caught.value.message
    health = httpx.get(f"{daemon.url}/health").json()
    # The restart may already be done (a cached model reloads in about a second).
    if health["models"]["smol"] != "loaded":
        assert health["models"]["smol"] == "restarting"
        assert health["status"] == "degraded"
    wait_for(lambda: httpx.get(f"{daemon.url}/health").json()["models"]["smol"] == "loaded")
    reply = oai(daemon).chat.completions.create(model="smol", messages=COUNT)
    assert reply.choices[0].message.content
    assert smol_stats(daemon)["restarts"] == 1
    assert "engine thread died" in daemon.log()
    assert "restarting it" in daemon.log()
