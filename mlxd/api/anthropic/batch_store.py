"""Message batches on disk, so that a restart loses no batch and no result.

One folder per batch under `<server.cache_dir>/message-batches/`: `batch.json` holds what the
batch is (its requests as sent, its owner, status and times) and is replaced atomically on
every change of status; `results.jsonl` gets one line per finished request, appended and
flushed as each finishes. A request that was running when the daemon stopped has no line, so
it runs again at the next start. The owner is `response_store.owner_of` the API key that made
the batch (a SHA-256, as stored responses use): the key itself is never written.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from mlxd.api.common.private_files import append_line, private_dir, read_lines, write_atomic
from mlxd.control.routes import OPEN, Caller

log = logging.getLogger("mlxd.batches")

Status = Literal["in_progress", "canceling", "ended"]
# What a batch written before `expires_at` was stored expires after (Anthropic's 24 hours).
DEFAULT_EXPIRY = timedelta(hours=24)


@dataclass
class StoredBatch:
    id: str
    owner: str
    # (custom_id, the Messages request as sent), in the order given.
    requests: list[tuple[str, dict[str, Any]]]
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    status: Status = "in_progress"
    cancel_initiated_at: datetime | None = None
    ended_at: datetime | None = None
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The models the creating key may use (None: every model); its requests run as that key.
    scope: list[str] | None = None
    expires_at: datetime | None = None  # set at creation: created_at + the configured expiry

    def __post_init__(self) -> None:
        if self.expires_at is None:
            self.expires_at = self.created_at + DEFAULT_EXPIRY

    def caller(self) -> Caller:
        if self.scope is None:
            return OPEN
        return Caller(admin=False, models=frozenset(self.scope))

    def meta(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "owner": self.owner,
            "requests": [{"custom_id": cid, "params": params} for cid, params in self.requests],
            "created_at": self.created_at.isoformat(),
            "status": self.status,
            "cancel_initiated_at": _iso(self.cancel_initiated_at),
            "ended_at": _iso(self.ended_at),
            "scope": self.scope,
            "expires_at": _iso(self.expires_at),
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any], results: dict[str, dict[str, Any]]) -> StoredBatch:
        return cls(
            id=meta["id"],
            owner=meta["owner"],
            requests=[(r["custom_id"], r["params"]) for r in meta["requests"]],
            created_at=datetime.fromisoformat(meta["created_at"]),
            status=meta["status"],
            cancel_initiated_at=_time(meta["cancel_initiated_at"]),
            ended_at=_time(meta["ended_at"]),
            results=results,
            scope=meta.get("scope"),
            expires_at=_time(meta.get("expires_at")),
        )


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment else None


def _time(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text) if text else None


class BatchStore:
    def __init__(self, root: Path):
        self.root = root

    def _dir(self, batch_id: str) -> Path:
        return self.root / batch_id

    def save(self, batch: StoredBatch) -> None:
        """Write the batch's description; a crash mid-write leaves the previous one whole."""
        private_dir(self.root)
        folder = private_dir(self._dir(batch.id))
        write_atomic(folder / "batch.json", json.dumps(batch.meta(), ensure_ascii=False))

    def add_result(self, batch: StoredBatch, custom_id: str, result: dict[str, Any]) -> None:
        batch.results[custom_id] = result
        line = json.dumps({"custom_id": custom_id, "result": result}, ensure_ascii=False)
        append_line(self._dir(batch.id) / "results.jsonl", line)

    def size(self, batch_id: str) -> int:
        """Bytes the batch takes on disk (its description and results)."""
        return sum(path.stat().st_size for path in self._dir(batch_id).glob("*") if path.is_file())

    def delete(self, batch_id: str) -> None:
        shutil.rmtree(self._dir(batch_id), ignore_errors=True)

    def load(self) -> list[StoredBatch]:
        """Every readable batch; an unreadable folder is logged and skipped, never fatal."""
        batches = []
        for folder in sorted(self.root.glob("msgbatch_*")):
            try:
                meta = json.loads((folder / "batch.json").read_text(encoding="utf-8"))
                batches.append(StoredBatch.from_meta(meta, _results(folder / "results.jsonl")))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("skipping unreadable message batch %s: %s", folder, exc)
        return batches


def _results(path: Path) -> dict[str, dict[str, Any]]:
    """The results file's lines; a torn last line (a crash mid-append) is not a result, and
    spoils no other."""
    results: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return results
    for line in read_lines(path):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        results[entry["custom_id"]] = entry["result"]
    return results
