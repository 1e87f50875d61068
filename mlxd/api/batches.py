"""Anthropic message batches: the requests run in the background through the same engines,
queued behind interactive requests (priority -1), a few at a time per batch so a large
batch never fills a model's queue. Kept in memory: a restart forgets batches."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from quart import Blueprint, Response, current_app

from mlxd.api.anthropic import create_message
from mlxd.api.errors import anthropic_error, from_validation_error
from mlxd.api.generation import new_id, parse_body
from mlxd.api.protocol.anthropic import MessagesRequest
from mlxd.errors import InvalidRequest, MlxdError, NotFound

blueprint = Blueprint("batches", __name__)

BATCH_PRIORITY = -1
PER_BATCH_CONCURRENCY = 4


class BatchItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    custom_id: str = Field(min_length=1, max_length=64)
    params: dict[str, Any]


class CreateBatch(BaseModel):
    requests: list[BatchItem] = Field(min_length=1, max_length=10_000)


@dataclass
class Batch:
    id: str
    requests: list[tuple[str, MessagesRequest]]
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    status: Literal["in_progress", "canceling", "ended"] = "in_progress"
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    cancel_initiated_at: datetime | None = None
    ended_at: datetime | None = None
    task: asyncio.Task | None = None

    def counts(self) -> dict[str, int]:
        kinds = [r["type"] for r in self.results.values()]
        return {
            "processing": len(self.requests) - len(self.results),
            "succeeded": kinds.count("succeeded"),
            "errored": kinds.count("errored"),
            "canceled": kinds.count("canceled"),
            "expired": 0,
        }

    def to_json(self) -> dict[str, Any]:
        ended = self.status == "ended"
        return {
            "id": self.id,
            "type": "message_batch",
            "processing_status": self.status,
            "request_counts": self.counts(),
            "created_at": _iso(self.created_at),
            "expires_at": _iso(self.created_at + timedelta(hours=24)),
            "cancel_initiated_at": _iso(self.cancel_initiated_at),
            "ended_at": _iso(self.ended_at),
            "archived_at": None,
            "results_url": f"/v1/messages/batches/{self.id}/results" if ended else None,
        }


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat().replace("+00:00", "Z") if moment else None


def _batches() -> dict[str, Batch]:
    return current_app.extensions.setdefault("message_batches", {})


def _get(batch_id: str) -> Batch:
    batch = _batches().get(batch_id)
    if batch is None:
        raise NotFound(f"message batch '{batch_id}' does not exist")
    return batch


@blueprint.post("/v1/messages/batches")
async def create() -> Any:
    body = await parse_body(CreateBatch)
    requests, seen = [], set()
    for index, item in enumerate(body.requests):
        if item.custom_id in seen:
            raise InvalidRequest(f"custom_id '{item.custom_id}' is used twice")
        seen.add(item.custom_id)
        try:
            params = MessagesRequest.model_validate(item.params)
        except ValidationError as exc:
            error = from_validation_error(exc)
            raise InvalidRequest(f"requests.{index}.params: {error.message}") from exc
        if params.stream:
            raise InvalidRequest(f"requests.{index}.params: stream is not allowed in a batch")
        requests.append((item.custom_id, params))
    batch = Batch(new_id("msgbatch_"), requests)
    batch.task = asyncio.create_task(_run(batch, current_app._get_current_object()))
    _batches()[batch.id] = batch
    return batch.to_json()


async def _run(batch: Batch, app: Any) -> None:
    slots = asyncio.Semaphore(PER_BATCH_CONCURRENCY)

    async def one(custom_id: str, params: MessagesRequest) -> None:
        async with slots:
            try:
                message = await create_message(params, priority=BATCH_PRIORITY)
                batch.results[custom_id] = {"type": "succeeded", "message": message}
            except MlxdError as exc:
                batch.results[custom_id] = {"type": "errored", "error": anthropic_error(exc)}

    try:
        async with app.app_context():
            await asyncio.gather(*(one(cid, params) for cid, params in batch.requests))
    finally:  # finished, or cancelled: what did not run is reported as canceled
        for custom_id, _ in batch.requests:
            batch.results.setdefault(custom_id, {"type": "canceled"})
        batch.status, batch.ended_at = "ended", datetime.now(UTC)


@blueprint.get("/v1/messages/batches")
async def list_batches() -> Any:
    data = [b.to_json() for b in sorted(_batches().values(), key=lambda b: b.created_at)][::-1]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"data": data, "has_more": False, "first_id": first, "last_id": last}


@blueprint.get("/v1/messages/batches/<batch_id>")
async def retrieve(batch_id: str) -> Any:
    return _get(batch_id).to_json()


@blueprint.post("/v1/messages/batches/<batch_id>/cancel")
async def cancel(batch_id: str) -> Any:
    batch = _get(batch_id)
    if batch.status == "in_progress":
        batch.status, batch.cancel_initiated_at = "canceling", datetime.now(UTC)
        batch.task.cancel()
    return batch.to_json()


@blueprint.get("/v1/messages/batches/<batch_id>/results")
async def results(batch_id: str) -> Any:
    batch = _get(batch_id)
    if batch.status != "ended":
        raise InvalidRequest(f"message batch '{batch_id}' is still {batch.status}")
    lines = (
        json.dumps({"custom_id": cid, "result": batch.results[cid]}) + "\n"
        for cid, _ in batch.requests
    )
    return Response("".join(lines), mimetype="application/x-jsonl")
