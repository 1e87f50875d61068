"""Message batches outlive the daemon: created, stopped, started again on the same cache_dir,
read back with the official SDK; each batch is visible only to the key that made it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import anthropic
import pytest

from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

KEYS = ["key-a", "key-b"]


def client(daemon: Daemon, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daemon.url, api_key=key, max_retries=0)


def requests(prefix: str, questions: list[str], max_tokens: int) -> list[dict]:
    return [
        {
            "custom_id": f"{prefix}{i}",
            "params": {
                "model": "smol",
                "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": question}],
            },
        }
        for i, question in enumerate(questions)
    ]


def wait_until_ended(sdk: anthropic.Anthropic, batch_id: str, timeout: float = 300) -> object:
    deadline = time.monotonic() + timeout
    batch = sdk.messages.batches.retrieve(batch_id)
    while batch.processing_status != "ended" and time.monotonic() < deadline:
        time.sleep(0.5)
        batch = sdk.messages.batches.retrieve(batch_id)
    assert batch.processing_status == "ended"
    return batch


def results(sdk: anthropic.Anthropic, batch_id: str) -> dict[str, dict]:
    return {r.custom_id: r.result.to_dict() for r in sdk.messages.batches.results(batch_id)}


@pytest.fixture
def cache_dir(tmp_path: Path, mlxd_cache_dir: Path) -> Path:
    """A cache_dir of this test's own (so its batches are its own), sharing the session's
    converted weights so that nothing is converted again."""
    shared = mlxd_cache_dir / "gguf"
    shared.mkdir(exist_ok=True)
    own = tmp_path / "cache"
    own.mkdir()
    (own / "gguf").symlink_to(shared, target_is_directory=True)
    return own


def test_batches_survive_a_restart_and_belong_to_their_key(tmp_path: Path, cache_dir: Path):
    config = {
        "server": {"cache_dir": str(cache_dir), "api_keys": KEYS},
        "models": {"smol": {"source": SMOL_GGUF, "defaults": {"temperature": 0.0}}},
    }
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
    first = start_daemon(tmp_path / "first", config)
    try:
        owner = client(first, "key-a")
        done = owner.messages.batches.create(
            requests=requests("done", ["What is the capital of France?", "Say hi."], 16)
        )
        wait_until_ended(owner, done.id)
        before = results(owner, done.id)
        # Long enough that the daemon is likely stopped with this one unfinished.
        pending = owner.messages.batches.create(
            requests=requests("pending", ["Count to fifty.", "List ten fruits.", "Hi"], 64)
        )
    finally:
        assert first.stop() == 0
    on_disk = cache_dir / "message-batches" / pending.id / "results.jsonl"
    finished_before_restart = len(on_disk.read_text().splitlines()) if on_disk.exists() else 0

    second = start_daemon(tmp_path / "second", config)
    try:
        owner = client(second, "key-a")
        assert owner.messages.batches.retrieve(done.id).processing_status == "ended"
        assert results(owner, done.id) == before
        assert "Paris" in before["done0"]["message"]["content"][0]["text"]
        resumed = wait_until_ended(owner, pending.id)
        assert resumed.request_counts.succeeded == 3
        assert set(results(owner, pending.id)) == {"pending0", "pending1", "pending2"}
        if finished_before_restart < 3:
            assert f"resuming message batch {pending.id}" in second.log()
        assert {b.id for b in owner.messages.batches.list()} >= {done.id, pending.id}

        stranger = client(second, "key-b")
        with pytest.raises(anthropic.NotFoundError):
            stranger.messages.batches.retrieve(done.id)
        with pytest.raises(anthropic.NotFoundError):
            list(stranger.messages.batches.results(done.id))
        with pytest.raises(anthropic.NotFoundError):
            stranger.messages.batches.cancel(pending.id)
        assert [b.id for b in stranger.messages.batches.list()] == []

        deleted = owner.messages.batches.delete(done.id)
        assert deleted.id == done.id and deleted.type == "message_batch_deleted"
        with pytest.raises(anthropic.NotFoundError):
            owner.messages.batches.retrieve(done.id)
        assert not (cache_dir / "message-batches" / done.id).exists()
        assert "key-a" not in json.dumps(
            json.loads((cache_dir / "message-batches" / pending.id / "batch.json").read_text())
        )
    finally:
        second.stop()
