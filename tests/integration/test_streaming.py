"""Streaming knobs and MLX's memory through the real daemon: stream_interval in every dialect,
a bounded backlog that cuts off a client that stops reading, server.metal and MLX's figures."""

from __future__ import annotations

import json
import math
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

ASK = [{"role": "user", "content": "Tell me about the sea in two sentences."}]
MAX_TOKENS = 40
# Small, so that a stalled client is cut off soon, but not so small that a reading one is:
# the backlog is counted in decode steps, and a daemon busy for 8 of them (≈ 80 ms at batch 1
# on the CPU kernels) cut off the stream_interval test's reader in a CI run.
BACKLOG = 64
NO_EOS = {"2": -100}  # SmolLM2's <|im_end|>: the stream runs to max_tokens


def smol(**overrides: Any) -> dict[str, Any]:
    return {
        "source": SMOL_GGUF,
        "context_length": 4096,
        "cache": {"ram": "64MiB"},
        "defaults": {"max_tokens": MAX_TOKENS, "temperature": 0.0},
        **overrides,
    }


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    config = {
        "server": {
            "cache_dir": str(mlxd_cache_dir),
            "stream_backlog": BACKLOG,
            "metal": {"wired_limit": "1GiB", "cache_limit": "256MiB"},
        },
        "models": {"smol": smol()},
    }
    running = start_daemon(tmp_path_factory.mktemp("streaming"), config)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0)


def reload(daemon: Daemon, models: dict[str, Any]) -> None:
    config = yaml.safe_load(daemon.config_path.read_text())
    daemon.config_path.write_text(yaml.safe_dump({**config, "models": models}))
    reply = httpx.post(f"{daemon.url}/admin/reload", timeout=60)
    assert reply.status_code == 200, reply.text


def openai_chunks(client: openai.OpenAI) -> list[str]:
    stream = client.chat.completions.create(model="smol", messages=ASK, stream=True)
    return [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]


def ollama_chunks(daemon: Daemon) -> list[str]:
    body = {"model": "smol", "messages": ASK, "options": {"temperature": 0, "num_predict": 40}}
    with httpx.stream("POST", f"{daemon.url}/api/chat", json=body, timeout=120) as reply:
        lines = [json.loads(line) for line in reply.iter_lines() if line]
    return [line["message"]["content"] for line in lines if line["message"]["content"]]


def test_stream_interval_sends_runs_of_tokens_in_every_dialect(
    daemon: Daemon, client: openai.OpenAI
):
    single = openai_chunks(client)
    assert len(single) > 8
    assert ollama_chunks(daemon) == single
    reload(daemon, {"smol": smol(stream_interval=4)})
    try:
        runs = openai_chunks(client)
        assert "".join(runs) == "".join(single)  # temperature 0: the same text, fewer chunks
        assert len(runs) == math.ceil(len(single) / 4)
        assert ollama_chunks(daemon) == runs
    finally:
        reload(daemon, {"smol": smol()})


def wait_for(predicate, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


def test_a_client_that_stops_reading_is_cut_off(daemon: Daemon, client: openai.OpenAI):
    # Long streams with fat chunks (4 sequences, 20 alternatives per token) soon fill the
    # socket's buffers, kept small by a small receive buffer and segment size (on loopback
    # the daemon's send buffer would otherwise grow to megabytes); then the backlog fills.
    body = {
        "model": "smol",
        "messages": ASK,
        "stream": True,
        "n": 4,
        "logprobs": True,
        "top_logprobs": 20,
        "max_tokens": 3000,
        "logit_bias": NO_EOS,
    }
    payload = json.dumps(body).encode()
    host, port = daemon.url.removeprefix("http://").split(":")
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    stalled.connect((host, int(port)))
    stalled.sendall(
        # A Host the daemon serves: any other is refused as DNS rebinding (no keys are set).
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n".encode()
        + b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    try:
        # Others are served while it stalls.
        wait_for(lambda: daemon.status()["models"]["smol"]["running"] > 0)
        other = client.chat.completions.create(model="smol", messages=ASK, max_tokens=8)
        assert other.choices[0].message.content
        wait_for(lambda: f"fell {BACKLOG} events behind (server.stream_backlog)" in daemon.log())
        # One line for the response (not one per sequence), with the access log's id.
        log = daemon.log().splitlines()
        lines = [line for line in log if "WARNING mlxd.api" in line and "stream_backlog" in line]
        assert len(lines) == 1 and "model 'smol': request req_" in lines[0]
        request_id = lines[0].split("request ")[1].split()[0]
        wait_for(lambda: daemon.status()["models"]["smol"]["running"] == 0, timeout=30)
        # What was already in the socket's buffers, then the end: no [DONE].
        stalled.settimeout(30)
        received = b""
        while chunk := stalled.recv(1 << 16):
            received += chunk
        assert received.startswith(b"HTTP/1.1 200")
        assert b"[DONE]" not in received
    finally:
        stalled.close()
    # Logged as a client that left.
    wait_for(lambda: f"request_id={request_id} model=smol" in daemon.log(), timeout=30)
    access = next(line for line in daemon.log().splitlines() if f"request_id={request_id} " in line)
    assert "status=499" in access
    assert client.chat.completions.create(model="smol", messages=ASK, max_tokens=4).choices


def test_status_reports_mlx_memory_and_the_limits_are_applied(daemon: Daemon):
    smol = daemon.status()["models"]["smol"]
    assert smol["mlx_active_bytes"] > 0  # what it allocated: norms, KV (packed weights are mapped)
    assert smol["mlx_peak_bytes"] >= smol["mlx_active_bytes"]
    # MLX's buffer cache stays within the cache_limit the worker set (checked below).
    assert 0 <= smol["mlx_cache_bytes"] <= 268_435_456
    log = daemon.log()
    assert "model 'smol': MLX memory limits set: cache_limit=268435456" in log
    # This backend (CPU in CI) wires no memory: said, not silently dropped.
    assert "server.metal.wired_limit ignored" in log or "wired_limit=1073741824" in log
