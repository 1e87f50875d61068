"""Stored responses (`store: true`, the Responses API default) on disk, for retrieve, delete
and `previous_response_id`.

One JSON file per response under `<server.cache_dir>/responses/`, so they survive a restart.
Each records its owner: a SHA-256 digest of the API key that made it (never the key itself;
"" when the daemon is open), and another key is told 404, as if it did not exist. Files older
than `server.responses_ttl` are expired: a read ignores them and writes prune them lazily,
at most once per PRUNE_INTERVAL_S, so nothing runs in the background.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from mlxd.api.common.private_files import private_dir, write_atomic
from mlxd.errors import NotFound

PRUNE_INTERVAL_S = 3600.0
# Ids are ours (`resp_` + hex): anything else cannot name a stored file, nor escape the folder.
_ID = re.compile(r"resp_[0-9a-f]{1,64}")


class ResponseStore:
    def __init__(self, folder: Path, ttl_s: float) -> None:
        self.folder = folder
        self.ttl_s = ttl_s
        self._pruned_at = float("-inf")  # the first write prunes

    def save(self, owner: str, response: dict[str, Any], input_items: list[dict]) -> None:
        """Store `response` with the whole input it answered (earlier turns included), which a
        later `previous_response_id` continues from."""
        private_dir(self.folder)
        record = {"owner": owner, "response": response, "input": input_items}
        write_atomic(self._path(response["id"]), json.dumps(record, ensure_ascii=False))
        self._prune()

    def load(self, owner: str, response_id: str) -> dict[str, Any]:
        """The stored record ({"response", "input"}), or NotFound if missing, expired or not
        this owner's."""
        path = self._path(response_id) if _ID.fullmatch(response_id) else None
        try:
            if path is None or self._expired(path.stat().st_mtime):
                raise FileNotFoundError
            record = json.loads(path.read_text(encoding="utf-8"))
        except (FileNotFoundError, json.JSONDecodeError):
            record = None
        if record is None or record.get("owner") != owner:
            raise NotFound(f"response '{response_id}' does not exist", param="response_id")
        return record

    def delete(self, owner: str, response_id: str) -> None:
        self.load(owner, response_id)  # 404 unless this owner's
        self._path(response_id).unlink(missing_ok=True)

    def _path(self, response_id: str) -> Path:
        return self.folder / f"{response_id}.json"

    def _expired(self, mtime: float) -> bool:
        return time.time() - mtime > self.ttl_s

    def _prune(self) -> None:
        now = time.monotonic()
        if now - self._pruned_at < PRUNE_INTERVAL_S:
            return
        self._pruned_at = now
        for path in self.folder.glob("resp_*.json"):
            try:
                if self._expired(path.stat().st_mtime):
                    path.unlink()
            except FileNotFoundError:
                pass  # another prune or a delete got there first
