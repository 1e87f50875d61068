"""Stores with limits against the real daemon: per-key quotas of Message Batches and stored
Responses (refused in each caller's error shape), batches that expire and are deleted after
their retention, expired responses deleted at start, stored turns that do not copy the
conversation, and a server key's view and cancel of every key's batches."""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from mlxd.api.anthropic.batch_store import BatchStore, StoredBatch
from mlxd.api.middleware.auth import owner_of
from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

ADMIN = "admin-key"
HI = [{"role": "user", "content": "Say hi."}]
PARAMS = {"model": "smol", "max_tokens": 1, "messages": HI}


def seed(cache_dir: Path) -> None:
    """What an earlier daemon left: a batch that ran past its expiry while the daemon was down,
    an ended one past its retention, a stored response past the responses' TTL."""
    store = BatchStore(cache_dir / "message-batches")
    two_days_ago = datetime.now(UTC) - timedelta(days=2)
    late = StoredBatch(
        "msgbatch_late", owner_of("key-a"), [("a", PARAMS), ("b", PARAMS)], two_days_ago
    )
    store.save(late)
    old = StoredBatch(
        "msgbatch_old", owner_of("key-a"), [("a", PARAMS)], two_days_ago - timedelta(days=28)
    )
    old.status, old.ended_at = "ended", old.created_at
    store.save(old)
    folder = cache_dir / "responses" / owner_of("key-b")
    folder.mkdir(parents=True)
    stale = folder / "resp_0dd.json"
    record = {"owner": owner_of("key-b"), "response": {"id": "resp_0dd", "output": []}}
    stale.write_text(json.dumps({**record, "input": [], "previous": None}))
    month_ago = time.time() - 31 * 86400
    os.utime(stale, (month_ago, month_ago))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path) -> Path:
    shared = mlxd_cache_dir / "gguf"
    shared.mkdir(exist_ok=True)
    own = tmp_path_factory.mktemp("stores") / "cache"
    own.mkdir()
    (own / "gguf").symlink_to(shared, target_is_directory=True)
    seed(own)
    return own


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path):
    config = {
        "server": {
            "cache_dir": str(cache_dir),
            "api_keys": [ADMIN],
            "message_batches": {"max_batches": 3},
            "stored_responses": {"max_responses": 2},
        },
        "models": {
            "smol": {
                "source": SMOL_GGUF,
                "context_length": 512,
                "api_keys": ["key-a", "key-b", "key-c"],
                "defaults": {"temperature": 0.0},
            },
        },
    }
    running = start_daemon(tmp_path_factory.mktemp("stores-daemon"), config)
    yield running
    running.stop()


def claude(daemon: Daemon, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daemon.url, api_key=key, max_retries=0)


def gpt(daemon: Daemon, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key=key, max_retries=0)


def test_what_was_left_expires_or_is_deleted_at_start(daemon: Daemon, cache_dir: Path):
    sdk = claude(daemon, "key-a")
    late = sdk.messages.batches.retrieve("msgbatch_late")
    assert late.processing_status == "ended"
    assert late.request_counts.expired == 2 and late.request_counts.succeeded == 0
    kinds = {r.custom_id: r.result.type for r in sdk.messages.batches.results("msgbatch_late")}
    assert kinds == {"a": "expired", "b": "expired"}
    with pytest.raises(anthropic.NotFoundError):
        sdk.messages.batches.retrieve("msgbatch_old")
    assert not (cache_dir / "message-batches" / "msgbatch_old").exists()
    assert not (cache_dir / "responses" / owner_of("key-b") / "resp_0dd.json").exists()


def test_a_new_batch_expires_a_day_after_creation(daemon: Daemon):
    batch = claude(daemon, "key-c").messages.batches.create(
        requests=[{"custom_id": "x", "params": PARAMS}]
    )
    assert batch.expires_at - batch.created_at == timedelta(hours=24)


def test_the_batch_quota_is_per_key_in_anthropics_shape(daemon: Daemon):
    sdk = claude(daemon, "key-b")
    for index in range(3):
        sdk.messages.batches.create(requests=[{"custom_id": f"q{index}", "params": PARAMS}])
    with pytest.raises(anthropic.BadRequestError) as caught:
        sdk.messages.batches.create(requests=[{"custom_id": "over", "params": PARAMS}])
    error = caught.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert "server.message_batches.max_batches" in error["message"]
    # key-a keeps one batch (the expired one): its own quota is not spent.
    claude(daemon, "key-a").messages.batches.create(requests=[{"custom_id": "a", "params": PARAMS}])


def test_a_server_key_lists_and_cancels_every_keys_batches(daemon: Daemon):
    many = [
        {"custom_id": f"r{i}", "params": {**PARAMS, "max_tokens": 64, "messages": HI}}
        for i in range(40)
    ]
    mine = claude(daemon, "key-a").messages.batches.create(requests=many)
    admin = {"x-api-key": ADMIN}
    listed = httpx.get(f"{daemon.url}/admin/message-batches", headers=admin, timeout=30).json()
    owners = {b["id"]: b["owner"] for b in listed["data"]}
    assert owners[mine.id] == owner_of("key-a")[:12] and "msgbatch_late" in owners
    assert ADMIN not in json.dumps(listed) and "key-a" not in json.dumps(listed)
    cancel = httpx.post(
        f"{daemon.url}/admin/message-batches/{mine.id}/cancel", headers=admin, timeout=30
    )
    assert cancel.status_code == 200 and cancel.json()["processing_status"] != "in_progress"
    sdk = claude(daemon, "key-a")
    deadline = time.monotonic() + 120
    while sdk.messages.batches.retrieve(mine.id).processing_status != "ended":
        assert time.monotonic() < deadline
        time.sleep(0.3)
    assert sdk.messages.batches.retrieve(mine.id).request_counts.canceled > 0
    # A model key is not an admin.
    refused = httpx.get(
        f"{daemon.url}/admin/message-batches", headers={"x-api-key": "key-a"}, timeout=30
    )
    assert refused.status_code == 403


def test_stored_responses_have_a_quota_and_store_only_their_own_turn(
    daemon: Daemon, cache_dir: Path
):
    sdk = gpt(daemon, "key-c")
    first = sdk.responses.create(model="smol", input="Hi, I am Ada.", max_output_tokens=2)
    second = sdk.responses.create(
        model="smol", input="What is my name?", previous_response_id=first.id, max_output_tokens=2
    )
    stored = json.loads(
        (cache_dir / "responses" / owner_of("key-c") / f"{second.id}.json").read_text()
    )
    assert [item["content"] for item in stored["input"]] == ["What is my name?"]
    assert stored["previous"] == first.id
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.responses.create(model="smol", input="One more.", max_output_tokens=2)
    assert caught.value.body["param"] == "store"
    assert "server.stored_responses.max_responses" in caught.value.body["message"]
    assert sdk.responses.create(model="smol", input="hi", max_output_tokens=2, store=False)
    assert gpt(daemon, "key-a").responses.create(model="smol", input="hi", max_output_tokens=2)
    sdk.responses.delete(first.id)
    assert sdk.responses.create(model="smol", input="Now it fits.", max_output_tokens=2)
