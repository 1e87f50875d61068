"""Message batches on disk: what a restart reads back, and what it must survive."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

from mlxd.api.anthropic.batch_store import BatchStore, StoredBatch
from mlxd.api.anthropic.batches import Batches, to_json
from mlxd.api.middleware.auth import owner_of

PARAMS = {"model": "smol", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def test_a_batch_and_its_results_come_back(tmp_path: Path):
    store = BatchStore(tmp_path)
    batch = StoredBatch("msgbatch_1", owner_of("key-a"), [("a", PARAMS), ("b", PARAMS)])
    store.save(batch)
    store.add_result(batch, "a", {"type": "succeeded", "message": {"content": []}})
    (loaded,) = BatchStore(tmp_path).load()
    assert loaded.meta() == batch.meta()
    assert loaded.results == {"a": {"type": "succeeded", "message": {"content": []}}}


def test_a_torn_last_result_line_is_not_a_result(tmp_path: Path):
    store = BatchStore(tmp_path)
    batch = StoredBatch("msgbatch_1", owner_of(None), [("a", PARAMS), ("b", PARAMS)])
    store.save(batch)
    store.add_result(batch, "a", {"type": "canceled"})
    with (tmp_path / "msgbatch_1" / "results.jsonl").open("a") as out:
        out.write('{"custom_id": "b", "res')  # the daemon died mid-write
    (loaded,) = store.load()
    assert set(loaded.results) == {"a"}  # "b" runs again


def test_an_unreadable_batch_is_skipped(tmp_path: Path):
    (tmp_path / "msgbatch_bad").mkdir()
    (tmp_path / "msgbatch_bad" / "batch.json").write_text("{not json")
    store = BatchStore(tmp_path)
    store.save(StoredBatch("msgbatch_ok", owner_of("k"), [("a", PARAMS)]))
    assert [b.id for b in store.load()] == ["msgbatch_ok"]


def test_the_owner_is_a_digest_never_the_key(tmp_path: Path):
    store = BatchStore(tmp_path)
    store.save(StoredBatch("msgbatch_1", owner_of("secret-key"), [("a", PARAMS)]))
    assert "secret-key" not in (tmp_path / "msgbatch_1" / "batch.json").read_text()
    assert owner_of("secret-key") != owner_of("other") and owner_of(None) == owner_of("")


def test_delete_removes_the_folder(tmp_path: Path):
    store = BatchStore(tmp_path)
    store.save(StoredBatch("msgbatch_1", owner_of("k"), [("a", PARAMS)]))
    store.delete("msgbatch_1")
    assert store.load() == [] and not (tmp_path / "msgbatch_1").exists()


def test_a_torn_multibyte_character_spoils_only_its_own_line(tmp_path: Path):
    store = BatchStore(tmp_path)
    batch = StoredBatch("msgbatch_1", owner_of(None), [("a", PARAMS), ("b", PARAMS)])
    store.save(batch)
    store.add_result(batch, "a", {"type": "succeeded", "message": {"content": "café ☕"}})
    with (tmp_path / "msgbatch_1" / "results.jsonl").open("ab") as out:
        out.write('{"custom_id": "b", "result": "☕'.encode()[:-1])  # cut inside the ☕
    (loaded,) = store.load()
    assert loaded.results == {"a": {"type": "succeeded", "message": {"content": "café ☕"}}}


def test_batches_are_private_to_the_daemons_user(tmp_path: Path):
    root = tmp_path / "message-batches"
    store = BatchStore(root)
    batch = StoredBatch("msgbatch_1", owner_of("k"), [("a", PARAMS)])
    store.save(batch)
    store.add_result(batch, "a", {"type": "canceled"})
    folder = root / "msgbatch_1"
    assert (root.stat().st_mode & 0o777, folder.stat().st_mode & 0o777) == (0o700, 0o700)
    for name in ("batch.json", "results.jsonl"):
        assert (folder / name).stat().st_mode & 0o777 == 0o600


def test_a_running_batch_past_expires_at_is_stopped_and_its_rest_expired(tmp_path: Path):
    async def scenario() -> tuple[Batches, StoredBatch, StoredBatch, asyncio.Task]:
        batches = Batches(BatchStore(tmp_path))
        now = datetime.now(UTC)
        running = StoredBatch(
            "msgbatch_run", owner_of("k"), [("a", PARAMS), ("b", PARAMS)], now - timedelta(hours=2)
        )
        running.expires_at = now - timedelta(hours=1)
        fresh = StoredBatch("msgbatch_new", owner_of("k"), [("a", PARAMS)], now)
        for batch in (running, fresh):
            batches.store.save(batch)
            batches.all[batch.id] = batch
        batches.store.add_result(running, "a", {"type": "succeeded", "message": {}})
        # What `Batches.run` starts: a task working through the requests, here still on "b".
        work = batches.tasks[running.id] = asyncio.create_task(asyncio.sleep(3600))
        await batches.sweep(now, retention=timedelta(days=29))
        return batches, running, fresh, work

    batches, running, fresh, work = asyncio.run(scenario())
    assert work.cancelled() and running.id not in batches.tasks
    assert running.status == "ended"
    assert {cid: r["type"] for cid, r in running.results.items()} == {
        "a": "succeeded",
        "b": "expired",
    }
    assert to_json(running)["request_counts"]["expired"] == 1
    assert fresh.status == "in_progress"
    (reloaded,) = [b for b in BatchStore(tmp_path).load() if b.id == running.id]
    assert reloaded.status == "ended" and reloaded.results["b"] == {"type": "expired"}


def test_a_batch_past_its_retention_is_deleted(tmp_path: Path):
    batches = Batches(BatchStore(tmp_path))
    old = StoredBatch("msgbatch_old", owner_of("k"), [("a", PARAMS)])
    batches.store.save(old)
    batches.all[old.id] = old
    later = old.created_at + timedelta(days=30)
    asyncio.run(batches.sweep(later, retention=timedelta(days=29)))
    assert batches.all == {} and not (tmp_path / "msgbatch_old").exists()
