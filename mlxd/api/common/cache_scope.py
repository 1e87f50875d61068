"""The prefix-cache partition of a request: with API keys set, each key's prompts are cached
apart, so one key cannot learn from response times which prompts another key sent. The
worker gets an HMAC of the key's digest under a secret kept in `server.cache_dir` (0600),
never the key: the scope stays the same across restarts (the SSD tier's blocks still match)
and tells nothing of the key to whoever reads the cache files."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from functools import cache
from pathlib import Path

from mlxd.api.common.context import current_app
from mlxd.api.common.private_files import private_dir, write_atomic
from mlxd.api.middleware import auth

SECRET_FILE = "cache-scope.secret"


def cache_scope() -> str:
    """The current request's partition: "" (the shared one) on an open daemon."""
    config = current_app.daemon.config
    owner = auth.owner()
    if not owner or not auth.keys_required(config):  # open: a batch's owner names nobody
        return ""
    secret = _secret(config.server.cache_dir)
    return hmac.new(secret, owner.encode(), hashlib.sha256).hexdigest()[:32]


@cache
def _secret(cache_dir: Path) -> bytes:
    path = cache_dir / SECRET_FILE
    if not path.exists():
        private_dir(cache_dir)
        write_atomic(path, secrets.token_hex(32))
    return bytes.fromhex(path.read_text(encoding="utf-8").strip())
