"""A sequence's hold on the prefix cache, from admission to its end.

The core asks it three things: how much of the prompt is cached (to budget the prefill), the KV
cache to start from (pinning those blocks), and, once the prompt has been prefilled, to keep the
blocks that were missing. Releasing unpins. Model thread only, like `PrefixCache.match`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlxd.cache.blocks import ROOT
from mlxd.cache.prefix import Match, PrefixCache

log = logging.getLogger("mlxd.cache")


@dataclass(eq=False)
class PrefixLease:
    cache: PrefixCache
    prompt_ids: list[int]
    keys: list[str]  # the prompt's block keys, computed off the model thread
    root: str = ROOT  # the root of the request's partition (`PrefixCache.root`)
    match: Match = field(default_factory=Match)
    _held: bool = False

    def lookup(self) -> int:
        """Cached prompt tokens right now (the uncached rest is what admission budgets)."""
        self.match = self.cache.match(self.prompt_ids, self.keys, self.root)
        return self.match.tokens

    def acquire(self) -> list[Any] | None:
        """Pin the matched blocks and count the hit or miss; the KV cache to start the prefill
        from (None: from scratch)."""
        self._held = True
        return self.cache.acquire(self.match, room=len(self.prompt_ids) - self.match.tokens) or None

    def store(self, layers: Callable[[], list[Any]]) -> None:
        """After the prompt's prefill: keep its blocks not cached yet. `layers()` gives the
        sequence's per-layer KV (only asked for when something is missing)."""
        if not self.cache.missing(self.keys):
            return
        try:
            self.cache.store(self.prompt_ids, self.keys, layers(), self.root)
        except Exception:  # a cache failure costs future hits, never this request
            log.exception("storing prompt blocks failed")

    def release(self) -> None:
        if self._held and self.match.blocks:
            self.cache.release(self.match.blocks)
        self._held = False
