"""Anthropic message batches (`/v1/messages/batches`): the requests run in the background
through the same engines, queued behind interactive requests (priority -1), a few at a time
per batch so a large batch never fills a model's queue.

Batches and their results are kept on disk under `server.cache_dir` (see `batch_store`): a
restart loses neither. Work that had not finished when the daemon stopped resumes at the next
start (a request that was running is run again from the start). Each batch is visible only to
the API key that created it; to any other caller it does not exist (404). A server key (or
anyone, on an open daemon) sees and cancels every key's batches under `/admin/message-batches`.

Each key may keep `server.message_batches.max_batches` batches of `max_bytes` on disk. A batch
still processing at its `expires_at` (`expiry` after creation) ends with what had not run
`expired`; `retention` after creation it is deleted with its results. Both are checked at
start and every SWEEP_INTERVAL_S.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from quart import Blueprint, Response, g, request

from mlxd.api.anthropic.batch_store import BatchStore, StoredBatch
from mlxd.api.anthropic.errors import anthropic_error
from mlxd.api.anthropic.messages import create_message
from mlxd.api.anthropic.protocol import MessagesRequest
from mlxd.api.common import housekeeping
from mlxd.api.common.context import current_app
from mlxd.api.common.error_shapes import from_validation_error
from mlxd.api.common.generation import new_id, parse_body
from mlxd.api.middleware import auth, ratelimit
from mlxd.api.middleware.auth import owner_of, presented_key
from mlxd.config.stores import BatchStoreConfig
from mlxd.errors import InvalidRequest, MlxdError, NotFound

log = logging.getLogger("mlxd.batches")

blueprint = Blueprint("batches", __name__)

BATCH_PRIORITY = -1
PER_BATCH_CONCURRENCY = 4


class BatchItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    custom_id: str = Field(min_length=1, max_length=64)
    params: dict[str, Any]


class CreateBatch(BaseModel):
    requests: list[BatchItem] = Field(min_length=1, max_length=10_000)


READY_POLL_S = 0.2
SWEEP_INTERVAL_S = 60.0
TokenCharge = Callable[[int], None]


def _uncharged(tokens: int) -> None:
    pass


class Batches:
    """The batches this daemon knows (all of them, loaded from disk at start) and the tasks
    running them."""

    def __init__(self, store: BatchStore):
        self.store = store
        self.all: dict[str, StoredBatch] = {b.id: b for b in store.load()}
        self.tasks: dict[str, asyncio.Task] = {}

    def run(self, batch: StoredBatch, app: Any, charge: TokenCharge = _uncharged) -> None:
        """Run `batch`'s unfinished requests; `charge` bills their tokens to the rate limits of
        the key that created it (a batch resumed at start is not billed again)."""
        self.tasks[batch.id] = asyncio.create_task(_run(batch, app, self, charge))

    async def stop(self, batch: StoredBatch) -> None:
        """Stop running `batch` (what was running gets no result), leaving it as it is."""
        await housekeeping.stop(self.tasks.pop(batch.id, None))

    def owned_by(self, owner: str) -> list[StoredBatch]:
        return [b for b in self.all.values() if b.owner == owner]

    def admit(self, owner: str | None, new_bytes: int, quota: BatchStoreConfig) -> None:
        """Refuse (400) a batch past `owner`'s quota of batches or bytes (None: everyone's
        together, as on an open daemon, where any key passes and so names nobody)."""
        kept = list(self.all.values()) if owner is None else self.owned_by(owner)
        used = sum(self.store.size(b.id) for b in kept)
        if len(kept) >= quota.max_batches:
            limit = f"{len(kept)} batches (server.message_batches.max_batches)"
        elif used + new_bytes > quota.max_bytes:
            limit = f"{used} bytes of batches (server.message_batches.max_bytes)"
        else:
            return
        raise InvalidRequest(
            f"this key keeps {limit}: delete ended batches, or wait for them to expire"
        )

    async def sweep(self, now: datetime, retention: timedelta) -> None:
        """End every batch past its expires_at (what had not run: `expired`); delete those
        created longer than `retention` ago."""
        for batch in list(self.all.values()):
            if now - batch.created_at > retention:
                await self.stop(batch)
                self.store.delete(batch.id)
                del self.all[batch.id]
                log.info("message batch %s deleted: past its retention", batch.id)
            elif batch.status == "in_progress" and batch.expires_at and now >= batch.expires_at:
                await self.stop(batch)
                _end(batch, self.store, "expired")
                log.info("message batch %s expired", batch.id)


def to_json(batch: StoredBatch) -> dict[str, Any]:
    kinds = [r["type"] for r in batch.results.values()]
    counted = ("succeeded", "errored", "canceled", "expired")
    ended = batch.status == "ended"
    return {
        "id": batch.id,
        "type": "message_batch",
        "processing_status": batch.status,
        "request_counts": {
            "processing": len(batch.requests) - len(batch.results),
            **{kind: kinds.count(kind) for kind in counted},
        },
        "created_at": _iso(batch.created_at),
        "expires_at": _iso(batch.expires_at),
        "cancel_initiated_at": _iso(batch.cancel_initiated_at),
        "ended_at": _iso(batch.ended_at),
        "archived_at": None,
        "results_url": f"/v1/messages/batches/{batch.id}/results" if ended else None,
    }


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat().replace("+00:00", "Z") if moment else None


def _batches() -> Batches:
    return current_app.extensions["message_batches"]


def _caller() -> str:
    return owner_of(presented_key(request.headers))


def _get(batch_id: str) -> StoredBatch:
    batch = _batches().all.get(batch_id)
    if batch is None or batch.owner != _caller():
        raise NotFound(f"message batch '{batch_id}' does not exist")
    return batch


@blueprint.before_app_serving
async def resume() -> None:
    """Load every batch from disk; run what a previous daemon left unfinished."""
    app: Any = current_app._get_current_object()  # type: ignore[attr-defined]
    batches = Batches(BatchStore(app.daemon.config.server.cache_dir / "message-batches"))
    app.extensions["message_batches"] = batches
    await _sweep()  # nothing expired or past retention is resumed
    for batch in batches.all.values():
        if batch.status == "in_progress":
            log.info(
                "resuming message batch %s: %d of %d requests left",
                batch.id,
                len(batch.requests) - len(batch.results),
                len(batch.requests),
            )
            batches.run(batch, app)
        elif batch.status == "canceling":  # stopped while canceling: finish the cancel
            _end(batch, batches.store)
    app.extensions["message_batch_sweep"] = housekeeping.every(app, SWEEP_INTERVAL_S, _sweep)


async def _sweep() -> None:
    retention = current_app.daemon.config.server.message_batches.retention
    await _batches().sweep(datetime.now(UTC), timedelta(seconds=retention))


@blueprint.after_app_serving
async def pause() -> None:
    """Stop running batches before the engines close (so no request fails for that), without
    ending them: the next start resumes them."""
    await housekeeping.stop(current_app.extensions.pop("message_batch_sweep", None))
    batches = current_app.extensions.get("message_batches")
    tasks = list(batches.tasks.values()) if batches else []
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@blueprint.post("/v1/messages/batches")
async def create() -> Any:
    body = await parse_body(CreateBatch)
    requests, seen = [], set()
    for index, item in enumerate(body.requests):
        if item.custom_id in seen:
            raise InvalidRequest(f"custom_id '{item.custom_id}' is used twice")
        seen.add(item.custom_id)
        params = _validated(item.params, index)
        if params.stream:
            raise InvalidRequest(f"requests.{index}.params: stream is not allowed in a batch")
        requests.append((item.custom_id, item.params))
    # Every item is a request to the rate limits (this HTTP request counted one).
    charge = ratelimit.admit_more(len(requests) - 1)
    caller = auth.caller()
    # Runs out of this request: its models are resolved for the key that created it.
    scope = None if caller.models is None else sorted(caller.models)
    quota = current_app.daemon.config.server.message_batches
    batches = _batches()
    keyed = auth.keys_required(current_app.daemon.config)
    batches.admit(_caller() if keyed else None, len(await request.get_data()), quota)
    created = datetime.now(UTC)
    batch = StoredBatch(
        new_id("msgbatch_"),
        _caller(),
        requests,
        created_at=created,
        scope=scope,
        expires_at=created + timedelta(seconds=quota.expiry),
    )
    batches.store.save(batch)
    batches.all[batch.id] = batch
    batches.run(batch, current_app._get_current_object(), charge)  # type: ignore[attr-defined]
    return to_json(batch)


def _validated(params: dict[str, Any], index: int) -> MessagesRequest:
    try:
        return MessagesRequest.model_validate(params)
    except ValidationError as exc:
        error = from_validation_error(exc)
        raise InvalidRequest(f"requests.{index}.params: {error.message}") from exc


async def _run(batch: StoredBatch, app: Any, batches: Batches, charge: TokenCharge) -> None:
    slots = asyncio.Semaphore(PER_BATCH_CONCURRENCY)

    async def one(custom_id: str, params: dict[str, Any]) -> None:
        async with slots:
            try:
                message = await create_message(_validated(params, 0), priority=BATCH_PRIORITY)
                charge(message["usage"]["input_tokens"] + message["usage"]["output_tokens"])
                result = {"type": "succeeded", "message": message}
            except MlxdError as exc:
                result = {"type": "errored", "error": anthropic_error(exc)}
            batches.store.add_result(batch, custom_id, result)

    pending = [(cid, params) for cid, params in batch.requests if cid not in batch.results]
    try:
        async with app.app_context():
            g.caller, g.owner = batch.caller(), batch.owner
            while not app.daemon.ready:  # resumed at start: the models are still loading
                await asyncio.sleep(READY_POLL_S)
            await asyncio.gather(*(one(cid, params) for cid, params in pending))
    except asyncio.CancelledError:
        if batch.status != "canceling":
            raise  # the daemon is stopping: the rest runs at the next start
    finally:
        batches.tasks.pop(batch.id, None)
    _end(batch, batches.store)


def _end(batch: StoredBatch, store: BatchStore, unfinished: str = "canceled") -> None:
    """What did not run is reported as `unfinished` (canceled, or expired)."""
    for custom_id, _ in batch.requests:
        if custom_id not in batch.results:
            store.add_result(batch, custom_id, {"type": unfinished})
    batch.status, batch.ended_at = "ended", datetime.now(UTC)
    store.save(batch)


@blueprint.get("/v1/messages/batches")
async def list_batches() -> Any:
    return _listing(_batches().owned_by(_caller()), to_json)


@blueprint.get("/admin/message-batches")
async def admin_list() -> Any:
    """Every key's batches (this path needs a server key), each with its owner: the first
    hex digits of the key's digest (`open` for an open daemon's), never the key."""
    return _listing(
        list(_batches().all.values()),
        lambda b: {**to_json(b), "owner": b.owner[:12] or "open"},
    )


def _listing(
    batches: list[StoredBatch], render: Callable[[StoredBatch], dict[str, Any]]
) -> dict[str, Any]:
    data = [render(b) for b in sorted(batches, key=lambda b: b.created_at, reverse=True)]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"data": data, "has_more": False, "first_id": first, "last_id": last}


@blueprint.get("/v1/messages/batches/<batch_id>")
async def retrieve(batch_id: str) -> Any:
    return to_json(_get(batch_id))


@blueprint.post("/v1/messages/batches/<batch_id>/cancel")
async def cancel(batch_id: str) -> Any:
    return _cancel(_get(batch_id))


@blueprint.post("/admin/message-batches/<batch_id>/cancel")
async def admin_cancel(batch_id: str) -> Any:
    """Cancel any key's batch (this path needs a server key)."""
    batch = _batches().all.get(batch_id)
    if batch is None:
        raise NotFound(f"message batch '{batch_id}' does not exist")
    return _cancel(batch)


def _cancel(batch: StoredBatch) -> dict[str, Any]:
    if batch.status == "in_progress":
        batch.status, batch.cancel_initiated_at = "canceling", datetime.now(UTC)
        _batches().store.save(batch)
        task = _batches().tasks.get(batch.id)
        if task is not None:
            task.cancel()
        else:
            _end(batch, _batches().store)
    return to_json(batch)


@blueprint.delete("/v1/messages/batches/<batch_id>")
async def delete(batch_id: str) -> Any:
    batch = _get(batch_id)
    if batch.status != "ended":
        raise InvalidRequest(f"message batch '{batch_id}' is still {batch.status}: cancel it first")
    _batches().store.delete(batch.id)
    del _batches().all[batch.id]
    return {"id": batch.id, "type": "message_batch_deleted"}


@blueprint.get("/v1/messages/batches/<batch_id>/results")
async def results(batch_id: str) -> Any:
    batch = _get(batch_id)
    if batch.status != "ended":
        raise InvalidRequest(f"message batch '{batch_id}' is still {batch.status}")
    lines = (
        json.dumps({"custom_id": cid, "result": batch.results[cid]}, ensure_ascii=False) + "\n"
        for cid, _ in batch.requests
    )
    return Response("".join(lines), mimetype="application/x-jsonl")
