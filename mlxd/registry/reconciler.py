"""Applies `plan()` to the running engines. The only writer of the route table.

Loads run in background tasks while the API keeps serving; when one is ready the route table
is replaced whole (atomically: readers hold either the old table or the new one). Replaced and
removed engines drain — they close once idle or after `server.drain_timeout`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mlxd.config import ModelConfig, ServerConfig
from mlxd.engines.base import Engine
from mlxd.engines.embedding import EmbeddingEngine
from mlxd.engines.llm import LLMEngine
from mlxd.engines.vlm import VLMEngine
from mlxd.errors import MlxdError, ModelLoadError, Unavailable
from mlxd.models.estimate import estimate_model_bytes
from mlxd.models.sources import resolve_source
from mlxd.registry.plan import (
    ENGINE_FIELDS,
    Action,
    Actual,
    Load,
    Rename,
    Resize,
    Retarget,
    Swap,
    Unload,
    describe,
    plan,
)
from mlxd.registry.routes import ModelEntry, RouteTable

log = logging.getLogger("mlxd.reconcile")

ENGINES: Mapping[str, type] = {"llm": LLMEngine, "vlm": VLMEngine, "embedding": EmbeddingEngine}
DRAIN_POLL_S = 0.05


@dataclass
class ModelRuntime:
    """One declared model's live state. `config` is the latest desired config: its routing
    settings apply at once; `built` is the config the serving `engine` was built with."""

    name: str
    config: ModelConfig
    engine: Engine | None = None
    built: ModelConfig | None = None
    error: str | None = None
    loading: asyncio.Task | None = None
    draining: list[Engine] = field(default_factory=list)
    restarts: int = 0  # engines replaced after their model thread died
    restarting: bool = False
    # Unloaded on demand (admin unload, Ollama keep_alive 0): an eager model is not reloaded
    # by the next reconcile, only by its next request.
    parked: bool = False
    # A client's keep-alive (Ollama's keep_alive) in seconds, over the YAML idle_ttl until the
    # next one; math.inf keeps the model loaded.
    keep_alive: float | None = None

    @property
    def idle_ttl(self) -> float | None:
        ttl = self.keep_alive if self.keep_alive is not None else self.config.idle_ttl
        return None if ttl == math.inf else ttl

    def observed(self) -> Actual:
        if self.loading is not None:
            return Actual(self.config, "loading")
        if self.engine is not None:
            # A swap that failed leaves the old engine: its settings are what actually runs.
            engine_fields = {f: getattr(self.built, f) for f in ENGINE_FIELDS}
            return Actual(self.config.model_copy(update=engine_fields), "loaded")
        if self.error is not None:
            return Actual(self.config, "failed")
        return Actual(self.config, "parked" if self.parked else "unloaded")

    @property
    def state(self) -> str:
        if self.engine is not None:
            return "restarting" if _dead(self.engine) else "loaded"
        if self.loading is not None:
            return "restarting" if self.restarting else "loading"
        return "failed" if self.error is not None else "unloaded"


def _dead(engine: Engine) -> bool:
    # Only engines with a model thread have a `failure`.
    return getattr(engine, "failure", None) is not None


class Reconciler:
    def __init__(self, server: ServerConfig, on_routes: Callable[[RouteTable], None]):
        self.server = server
        self.models: dict[str, ModelRuntime] = {}
        self._publish_to = on_routes
        self._retiring: set[asyncio.Task] = set()
        # Removed models whose engines still drain: shown in status, no longer routable.
        self.removed: list[ModelRuntime] = []
        self.loads: Counter[tuple[str, str]] = Counter()  # (model, "ok" | "failed")

    # -- reconcile ---------------------------------------------------------------------

    def apply(self, desired: Mapping[str, ModelConfig], server: ServerConfig) -> list[Action]:
        """Start converging on `desired`; returns the actions taken (loads continue after)."""
        self.server = server
        actions = plan(desired, {name: rt.observed() for name, rt in self.models.items()})
        for action in actions:
            log.info("reconcile: %s", describe(action))
            self._apply(action)
        self._publish()
        return actions

    def _apply(self, action: Action) -> None:
        if isinstance(action, Unload):
            runtime = self.models.pop(action.name)
            self._cancel_load(runtime)
            if runtime.engine is not None:
                self.removed.append(runtime)
                self._retire(runtime, runtime.engine)
                runtime.engine = None
        elif isinstance(action, Rename):
            runtime = self.models.pop(action.old)
            runtime.name, runtime.config = action.new, action.config
            runtime.engine.name = action.new
            self.models[action.new] = runtime
        elif isinstance(action, Retarget):
            self.models[action.name].config = action.config
        elif isinstance(action, Resize):
            runtime = self.models[action.name]
            runtime.config = action.config
            runtime.built = runtime.built.model_copy(update={"cache": action.config.cache})
            runtime.engine.resize_cache(action.config.cache)
        elif isinstance(action, Swap):
            runtime = self.models[action.name]
            runtime.config = action.config
            self._start_load(runtime)
        elif isinstance(action, Load):
            runtime = self.models.setdefault(action.name, ModelRuntime(action.name, action.config))
            runtime.config, runtime.error = action.config, None
            if action.config.load == "eager":
                self._start_load(runtime)

    # -- loading -----------------------------------------------------------------------

    def _start_load(self, runtime: ModelRuntime) -> asyncio.Task:
        self._cancel_load(runtime)
        runtime.loading = asyncio.create_task(self._load(runtime, runtime.config))
        return runtime.loading

    def _cancel_load(self, runtime: ModelRuntime) -> None:
        if runtime.loading is not None:
            runtime.loading.cancel()
            runtime.loading = None

    async def _load(self, runtime: ModelRuntime, config: ModelConfig) -> None:
        started = time.monotonic()
        task = asyncio.current_task()
        try:
            engine = await self._build(runtime, config)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            message = exc.message if isinstance(exc, MlxdError) else f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, MlxdError):
                log.exception("model '%s': unexpected load failure", runtime.name)
            if runtime.loading is task:
                self.loads[runtime.name, "failed"] += 1
                runtime.loading, runtime.error, runtime.restarting = None, message, False
                kept = "; the previous engine keeps serving" if runtime.engine else ""
                log.error("model '%s' failed to load%s: %s", runtime.name, kept, message)
                self._publish()
            return
        if runtime.loading is not task or self.models.get(runtime.name) is not runtime:
            await engine.close()  # superseded by a newer reconcile while loading
            return
        self.loads[runtime.name, "ok"] += 1
        previous = runtime.engine
        runtime.engine, runtime.built, runtime.error, runtime.loading = engine, config, None, None
        runtime.restarting = False
        self._publish()
        log.info(
            "model '%s' %s in %.1fs (%s, %.0f MB)",
            runtime.name,
            "swapped" if previous else "loaded",
            time.monotonic() - started,
            engine.stats().get("dtype"),
            engine.memory_bytes / 1e6,
        )
        if previous is not None:
            self._retire(runtime, previous)

    async def _build(self, runtime: ModelRuntime, config: ModelConfig) -> Engine:
        engine_cls = ENGINES.get(config.kind)
        if engine_cls is None:
            raise ModelLoadError(f"model '{runtime.name}': kind '{config.kind}' is not supported")
        cache_dir = self.server.cache_dir
        path: Path = await asyncio.to_thread(
            resolve_source, config.source, model_name=runtime.name, cache_dir=cache_dir
        )
        kv_budget = 0 if config.kind == "embedding" else config.cache.ram  # encoders keep no KV
        need = await asyncio.to_thread(estimate_model_bytes, path, config.dtype, kv_budget)
        await self._make_room(need, runtime)
        # What each kind needs beyond its weights: the SSD KV tier's root, the live media settings.
        extra = {"llm": {"cache_dir": cache_dir}, "vlm": {"server": lambda: self.server}}
        return await engine_cls.load(runtime.name, config, path, **extra.get(config.kind, {}))

    async def _make_room(self, need: int, loading: ModelRuntime) -> None:
        """Unload idle models, least recently used first, until `need` fits the budget."""
        budget = self.server.memory_budget
        if budget is None:
            return

        def in_use() -> int:
            engines = [e for rt in self.models.values() for e in (rt.engine, *rt.draining) if e]
            return sum(e.memory_bytes for e in engines)

        idle = sorted(
            (
                rt
                for rt in self.models.values()
                if rt is not loading and rt.engine is not None and rt.engine.idle
            ),
            key=lambda rt: rt.engine.last_used,
        )
        while in_use() + need > budget and idle:
            victim = idle.pop(0)
            log.info("memory budget: unloading idle model '%s' to make room", victim.name)
            drained = self._retire(victim, victim.engine)
            victim.engine = None
            self._publish()
            await drained  # idle, so it closes at once; its memory counts until then
        if in_use() + need > budget:
            busy = ", ".join(rt.name for rt in self.models.values() if rt.engine) or "none"
            raise Unavailable(
                f"model '{loading.name}' needs {need / 2**30:.2f} GiB but server.memory_budget "
                f"({budget / 2**30:.2f} GiB) has {max(budget - in_use(), 0) / 2**30:.2f} GiB "
                f"free; loaded and busy: {busy}"
            )

    async def engine_for(self, name: str) -> Engine:
        """The serving engine of model `name`, loading it first if it is lazy or still loading.

        Concurrent callers share one load. A load superseded by a reconcile is followed to its
        replacement; the whole wait is bounded by `server.load_timeout`.
        """
        runtime = self.models[name]
        runtime.parked = False
        deadline = time.monotonic() + self.server.load_timeout
        while runtime.engine is None:
            if self.models.get(name) is not runtime:
                raise Unavailable(f"model '{name}' was removed from the config while loading")
            loading = runtime.loading or self._start_load(runtime)
            self._publish()
            try:
                await asyncio.wait_for(asyncio.shield(loading), deadline - time.monotonic())
            except TimeoutError:
                raise Unavailable(
                    f"model '{name}' is still loading after {self.server.load_timeout:.0f}s "
                    "(server.load_timeout); retry shortly",
                    headers={"Retry-After": "5"},
                ) from None
            except asyncio.CancelledError:
                if not loading.cancelled():
                    raise  # it is this request that was cancelled
                continue  # the load was superseded: wait for the new one
            if runtime.engine is None and runtime.loading is None:
                raise Unavailable(f"model '{name}' failed to load: {runtime.error}")
        return runtime.engine

    # -- on demand ---------------------------------------------------------------------

    async def load_now(self, name: str) -> Engine:
        """Load a declared model now (admin load); it stays loaded until unloaded again."""
        return await self.engine_for(name)

    async def unload_now(self, name: str) -> None:
        """Unload a model now (admin unload, Ollama keep_alive 0) after its requests finish.
        It stays declared: its next request loads it again."""
        runtime = self.models[name]
        self._cancel_load(runtime)
        runtime.parked = True
        engine, runtime.engine = runtime.engine, None
        if engine is None:
            self._publish()
            return
        log.info("model '%s' unloaded on demand", name)
        drained = self._retire(runtime, engine)
        self._publish()
        await drained

    def set_keep_alive(self, name: str, seconds: float | None) -> None:
        """How long `name` stays loaded once idle, over its YAML idle_ttl (None: back to it)."""
        self.models[name].keep_alive = seconds

    # -- draining ----------------------------------------------------------------------

    def _retire(self, runtime: ModelRuntime, engine: Engine) -> asyncio.Task:
        runtime.draining.append(engine)
        task = asyncio.create_task(self._drain(runtime, engine))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        return task

    async def _drain(self, runtime: ModelRuntime, engine: Engine) -> None:
        deadline = time.monotonic() + self.server.drain_timeout
        while not engine.idle and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if not engine.idle:
            log.warning("model '%s': drain timeout; cutting in-flight requests", runtime.name)
        await engine.close()
        runtime.draining.remove(engine)
        if not runtime.draining and runtime in self.removed:
            self.removed.remove(runtime)

    def unload_idle(self, now: float) -> None:
        """Unload engines unused for longer than their model's idle_ttl (they reload lazily)."""
        for runtime in self.models.values():
            engine, ttl = runtime.engine, runtime.idle_ttl
            expired = ttl is not None and engine is not None and now - engine.last_used > ttl
            if expired and engine.idle:
                log.info("model '%s' idle for %.0fs: unloading", runtime.name, ttl)
                runtime.engine = None
                self._retire(runtime, engine)
                self._publish()

    def restart_dead(self) -> None:
        """Replace engines whose model thread died (their requests have already failed)."""
        for runtime in self.models.values():
            if runtime.engine is None or not _dead(runtime.engine):
                continue
            log.error("model '%s': %s; restarting it", runtime.name, runtime.engine.failure)
            runtime.error = runtime.engine.failure
            runtime.restarts += 1
            runtime.restarting = True
            self._retire(runtime, runtime.engine)
            runtime.engine = None
            self._start_load(runtime)
            self._publish()

    async def close(self) -> None:
        for runtime in self.models.values():
            self._cancel_load(runtime)
            if runtime.engine is not None:
                self._retire(runtime, runtime.engine)
                runtime.engine = None
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

    # -- routes ------------------------------------------------------------------------

    def _publish(self) -> None:
        self._publish_to(
            RouteTable(
                {
                    name: ModelEntry(name, rt.config, rt.state, engine=rt.engine, error=rt.error)
                    for name, rt in self.models.items()
                }
            )
        )

    def status(self) -> dict[str, dict]:
        """Per model: state, aliases, error, draining engines and the serving engine's stats."""
        rows = {}
        now = time.monotonic()
        for runtime in [*self.models.values(), *self.removed]:
            removed = runtime in self.removed
            engine = runtime.engine
            rows[runtime.name] = {
                "state": "draining" if removed else runtime.state,
                "kind": runtime.config.kind,
                "source": runtime.config.source,
                "load": runtime.config.load,
                "aliases": [] if removed else list(runtime.config.aliases),
                "error": runtime.error,
                "draining": len(runtime.draining),
                "restarts": runtime.restarts,
                # idle_ttl in force (YAML or a client's keep_alive); null: never unloaded idle.
                "idle_ttl_s": runtime.idle_ttl,
                "idle_s": round(now - engine.last_used, 1) if engine and engine.idle else 0.0,
                **(runtime.engine.stats() if runtime.engine is not None else {}),
            }
        return rows
