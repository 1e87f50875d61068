"""One declared model's live state, and the facts about it that `plan()` decides on."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Hashable
from dataclasses import dataclass, field

from mlxd.config import ModelConfig
from mlxd.control.plan import ENGINE_FIELDS, Actual, backoff
from mlxd.control.routes import ModelState
from mlxd.models.source_paths import source_stamp
from mlxd.runtime.engine import Engine

# A worker that served this long before dying starts its backoff from the beginning again.
BACKOFF_RESET_S = 60.0


@dataclass
class ModelRuntime:
    """`config` is the latest desired config (its routing settings apply at once); `built` is
    the config the serving `engine` was built with."""

    name: str
    config: ModelConfig
    engine: Engine | None = None
    built: ModelConfig | None = None
    error: str | None = None
    loading: asyncio.Task | None = None
    draining: list[Engine] = field(default_factory=list)
    restarts: int = 0  # engines replaced after their worker died
    restarting: bool = False  # between a death and the next engine that serves
    # Unloaded on demand or for idleness: not reloaded by the next reconcile, only by its next
    # request (or an admin load).
    parked: bool = False
    # A client's keep-alive (Ollama's keep_alive) in seconds, over the YAML idle_ttl until the
    # next one; math.inf keeps the model loaded.
    keep_alive: float | None = None
    # Failures in a row (deaths and failed loads) and when the next retry is due (monotonic).
    failures: int = 0
    retry_at: float = 0.0
    up_since: float | None = None  # when the serving engine became ready
    death_seen: Engine | None = None  # the dead engine whose failure is already counted
    # The last load failed in a way that recurs with the same files and config (an unsupported
    # or missing file): no retry until the source's stamp or the config changes.
    gave_up: bool = False
    stamp: Hashable = None  # source_stamp(config.source) when it gave up

    @property
    def idle_ttl(self) -> float | None:
        ttl = self.keep_alive if self.keep_alive is not None else self.config.idle_ttl
        return None if ttl == math.inf else ttl

    def dead(self) -> bool:
        return self.engine is not None and self.engine.failure is not None

    def record_failure(self, reason: str, now: float, *, recurs: bool = False) -> None:
        """Count a death or failed load and set when to retry (1 s, 2 s, 4 s … 60 s; never,
        for a failure that `recurs`, until `source_changed` or `retry_now`)."""
        served = self.up_since is not None and now - self.up_since >= BACKOFF_RESET_S
        self.failures = 1 if served else self.failures + 1
        self.retry_at = math.inf if recurs else now + backoff(self.failures)
        self.gave_up = recurs
        self.stamp = source_stamp(self.config.source) if recurs else None
        self.error = reason
        self.up_since = None

    def retry_now(self) -> None:
        self.retry_at, self.gave_up = 0.0, False

    def source_changed(self) -> bool:
        """A model that gave up whose source files have changed since (e.g. re-pulled)."""
        return self.gave_up and source_stamp(self.config.source) != self.stamp

    def observed(self, now: float) -> Actual:
        retry_in = self.retry_at - now
        if self.loading is not None:
            return Actual(self.config, "loading")
        if self.engine is not None:
            # A swap that failed leaves the old engine: its settings are what actually runs,
            # and the swap is retried once its backoff is over (never, if it gave up: until
            # the source or the config changes).
            running = self.config
            if self.error is None or retry_in <= 0:
                engine_fields = {f: getattr(self.built, f) for f in ENGINE_FIELDS}
                running = self.config.model_copy(update=engine_fields)
            if self.dead():
                return Actual(running, "dead", retry_in=retry_in)
            idle_for = now - self.engine.last_used if self.engine.idle else None
            return Actual(running, "loaded", idle_for=idle_for, idle_ttl=self.idle_ttl)
        if self.error is not None:
            return Actual(self.config, "failed", retry_in=retry_in)
        return Actual(self.config, "parked" if self.parked else "unloaded")

    @property
    def state(self) -> ModelState:
        """What /health, /v1/status and the route table show."""
        if self.engine is not None:
            return "restarting" if self.dead() else "loaded"
        if self.loading is not None or self.error is not None:
            if self.restarting:
                return "restarting"
            return "loading" if self.loading is not None else "failed"
        return "unloaded"
