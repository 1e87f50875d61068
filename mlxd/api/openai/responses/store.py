"""Stored responses (`store: true`, the Responses API default) on disk, for retrieve, delete
and `previous_response_id`.

One JSON file per response under `<server.cache_dir>/responses/<owner>/`, so they survive a
restart. The owner is a SHA-256 digest of the API key that made it (never the key itself;
`open` when the daemon is open), and another key is told 404, as if it did not exist. A file
holds its turn only: the response, the input of that request, and the id of the response it
continued; a conversation is read back by following those links, so a long one costs each turn
its own bytes, not a copy of everything before it. Continuing a turn renews the ones before it.

Files older than `server.responses_ttl` are expired: a read ignores them, and `prune` (at start
and periodically) deletes them. Each owner may keep `server.stored_responses` (a count and
bytes); at the quota a request that would store is refused before it runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlxd.api.common.private_files import private_dir, write_atomic
from mlxd.config.stores import ResponseStoreConfig
from mlxd.errors import InvalidRequest, NotFound

# Ids are ours (`resp_` + hex): anything else cannot name a stored file, nor escape the folder.
_ID = re.compile(r"resp_[0-9a-f]{1,64}")
OPEN_OWNER = "open"  # the folder of an open daemon's responses ("" is no folder name)


class ResponseStore:
    def __init__(self, folder: Path, ttl_s: float) -> None:
        self.folder = folder
        self.ttl_s = ttl_s

    def admit(self, owner: str | None, quota: ResponseStoreConfig) -> None:
        """Refuse (400) a request that would store one more response past `owner`'s quota
        (None: everyone's together, as on an open daemon, where any key passes)."""
        pattern = "*/resp_*.json" if owner is None else f"{_dir_name(owner)}/resp_*.json"
        sizes = list(self._live_sizes(pattern))
        count, size = len(sizes), sum(sizes)
        if count >= quota.max_responses:
            limit = f"{count} stored responses (server.stored_responses.max_responses)"
        elif size >= quota.max_bytes:
            limit = f"{size} bytes of stored responses (server.stored_responses.max_bytes)"
        else:
            return
        raise InvalidRequest(
            f"this key keeps {limit}: delete some, or send `store: false`", param="store"
        )

    def save(
        self,
        owner: str,
        response: dict[str, Any],
        own_input: list[dict],
        previous: str | None,
    ) -> None:
        """Store `response` with the input its request sent, linked to the `previous` response
        it continues (whose chain is renewed: it lives as long as this turn)."""
        folder = private_dir(private_dir(self.folder) / _dir_name(owner))
        record = {"owner": owner, "response": response, "input": own_input, "previous": previous}
        write_atomic(folder / f"{response['id']}.json", json.dumps(record, ensure_ascii=False))
        now = time.time()
        with contextlib.suppress(NotFound):  # a turn deleted meanwhile: the chain is cut anyway
            for turn in self._chain(owner, previous):
                os.utime(self._path(owner, turn["response"]["id"]), (now, now))

    def load(self, owner: str, response_id: str) -> dict[str, Any]:
        """The stored record ({"response", "input", "previous"}), or NotFound if missing,
        expired or not this owner's."""
        path = self._path(owner, response_id) if _ID.fullmatch(response_id) else None
        try:
            if path is None or self._expired(path.stat().st_mtime):
                raise FileNotFoundError
            record = json.loads(path.read_text(encoding="utf-8"))
        except (FileNotFoundError, json.JSONDecodeError):
            record = None
        if record is None or record.get("owner") != owner:
            raise NotFound(f"response '{response_id}' does not exist", param="response_id")
        return record

    def conversation(self, owner: str, response_id: str) -> list[dict]:
        """What a request continuing `response_id` starts from: every turn's input and output
        up to that response's, oldest first."""
        return [
            item
            for turn in self._chain(owner, response_id)
            for item in (*turn["input"], *turn["response"]["output"])
        ]

    def input_of(self, owner: str, response_id: str) -> list[dict]:
        """The whole input response `response_id` answered, earlier turns included."""
        record = self.load(owner, response_id)
        # Files of an older mlxd have no link: their input is the whole of it.
        return [*self.conversation(owner, record.get("previous") or ""), *record["input"]]

    def delete(self, owner: str, response_id: str) -> None:
        self.load(owner, response_id)  # 404 unless this owner's
        self._path(owner, response_id).unlink(missing_ok=True)

    def prune(self) -> None:
        """Delete every expired response (and move files of the flat layout older mlxd wrote
        into their owner's folder)."""
        for path in self.folder.glob("resp_*.json"):
            self._adopt(path)
        for path in self.folder.glob("*/resp_*.json"):
            try:
                if self._expired(path.stat().st_mtime):
                    path.unlink()
            except FileNotFoundError:
                pass  # a delete got there first

    def _chain(self, owner: str, response_id: str | None) -> list[dict[str, Any]]:
        """The records from the first turn to `response_id`'s (none for None); NotFound names
        a turn that was deleted or expired."""
        turns = []
        while response_id:
            turns.append(self.load(owner, response_id))
            response_id = turns[-1].get("previous")
        return turns[::-1]

    def _adopt(self, path: Path) -> None:
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            folder = private_dir(self.folder / _dir_name(record["owner"]))
            path.replace(folder / path.name)  # keeps its mtime, so its age
        except (OSError, ValueError, KeyError, TypeError):
            path.unlink(missing_ok=True)  # unreadable: no owner could ever read it

    def _live_sizes(self, pattern: str) -> Iterator[int]:
        """The size of each unexpired response whose path matches `pattern`."""
        for path in self.folder.glob(pattern):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue  # deleted meanwhile
            if not self._expired(stat.st_mtime):
                yield stat.st_size

    def _owner_dir(self, owner: str) -> Path:
        return self.folder / _dir_name(owner)

    def _path(self, owner: str, response_id: str) -> Path:
        return self._owner_dir(owner) / f"{response_id}.json"

    def _expired(self, mtime: float) -> bool:
        return time.time() - mtime > self.ttl_s


def _dir_name(owner: str) -> str:
    return owner or OPEN_OWNER
