"""Applies `plan()` to the running engines. The only writer of the route table.

Loads run in background tasks while the API keeps serving; when one is ready the route table
is replaced whole (atomically: readers hold either the old table or the new one). Replaced and
removed engines drain — they close once idle or after `server.drain_timeout`.

Before a load the memory budget makes room (control/memory_budget.py); models that differ only
in their adapter share an engine (control/share_groups.py); `status()` is the report of
control/status_report.py. `keep_spare` keeps a worker ready for the next load where one could
be needed (control/spare_policy.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import cast

from mlxd.config import ModelConfig, ServerConfig
from mlxd.control import memory_budget
from mlxd.control.model_runtime import ModelRuntime
from mlxd.control.plan import (
    Action,
    Load,
    Park,
    Rename,
    Resize,
    Restart,
    Retarget,
    Swap,
    Unload,
    describe,
    plan,
)
from mlxd.control.routes import ModelEntry, RouteTable
from mlxd.control.share_groups import share_key
from mlxd.control.spare_policy import spare_wanted
from mlxd.control.status_report import status_report
from mlxd.errors import MlxdError, ModelLoadError, Unavailable
from mlxd.memory_need import MemoryNeed
from mlxd.runtime import spare_worker
from mlxd.runtime.engine import Engine, EngineStarter
from mlxd.runtime.shared_pool import AdapterHost, EnginePool
from mlxd.runtime.worker_proxy import WorkerEngine

log = logging.getLogger("mlxd.reconcile")

DRAIN_POLL_S = 0.05
NOT_RETRIED = "not retried until its source files or the config change"


class Reconciler:
    def __init__(
        self,
        server: ServerConfig,
        on_routes: Callable[[RouteTable], None],
        start_inline: EngineStarter | None = None,
    ):
        self.server = server
        # `workers: inline` loads models into this process; the caller that may import MLX
        # hands in how (the daemon side never imports the worker side).
        self.start_inline = start_inline
        self.desired: Mapping[str, ModelConfig] = {}
        self.models: dict[str, ModelRuntime] = {}
        self._publish_to = on_routes
        self._retiring: set[asyncio.Task] = set()
        # Removed models whose engines still drain: shown in status, no longer routable.
        self.removed: list[ModelRuntime] = []
        self.loads: Counter[tuple[str, str]] = Counter()  # (model, "ok" | "failed")
        self.pool = EnginePool()  # engines shared by a base model and its adapters

    # -- reconcile ---------------------------------------------------------------------

    def apply(self, desired: Mapping[str, ModelConfig], server: ServerConfig) -> list[Action]:
        """Start converging on a new config; returns the actions taken (loads continue after).
        Failed models are retried at once: the change may have fixed them."""
        self.desired, self.server = desired, server
        for runtime in self.models.values():
            if runtime.error is not None:  # a failed load, or a failed swap beside its engine
                runtime.retry_now()
        return self.tick()

    def tick(self) -> list[Action]:
        """Converge on the current config again: also what turns deaths, idleness and ended
        backoffs into actions (the daemon calls this every second)."""
        now = time.monotonic()
        self._count_deaths(now)
        for runtime in self.models.values():
            if runtime.source_changed():
                log.info("model '%s': its source changed; loading it again", runtime.name)
                runtime.retry_now()
        actual = {name: runtime.observed(now) for name, runtime in self.models.items()}
        actions = plan(self.desired, actual)
        for action in actions:
            log.info("reconcile: %s", describe(action))
            self._apply(action)
        self._publish()
        return actions

    def keep_spare(self) -> None:
        """A worker imported ahead of the next load while some model could take it
        (control/spare_policy.py); the daemon calls this every second beside `tick`."""
        want = spare_wanted(
            self.models.values(),
            self.server,
            time.monotonic(),
            removed=self.removed,
            joins=self._joins_running_engine,
        )
        if want == "spawn":
            spare_worker.keep()
        elif want == "discard":
            spare_worker.discard()

    def _joins_running_engine(self, runtime: ModelRuntime) -> bool:
        key = share_key(runtime.name, runtime.config, self.desired)
        return key is not None and self.pool.serves(key)

    def _count_deaths(self, now: float) -> None:
        for runtime in self.models.values():
            engine = runtime.engine
            failure = engine.failure if engine is not None else None
            if failure is None or runtime.death_seen is engine:
                continue
            runtime.death_seen = engine
            runtime.restarting = True
            runtime.record_failure(failure, now)
            log.error(
                "model '%s': %s; restarting it in %.0fs (failure %d in a row)",
                runtime.name,
                failure,
                runtime.retry_at - now,
                runtime.failures,
            )

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
            if runtime.engine is not None:  # plan() moves loaded engines only
                runtime.engine.name = action.new
            self.models[action.new] = runtime
        elif isinstance(action, Retarget):
            self.models[action.name].config = action.config
        elif isinstance(action, Park):
            runtime = self.models[action.name]
            log.info("model '%s' idle for %.0fs: unloading", action.name, runtime.idle_ttl)
            self._park(runtime)
        elif isinstance(action, Restart):
            runtime = self.models[action.name]
            runtime.config = action.config
            runtime.restarts += 1
            if runtime.engine is not None:
                self._retire(runtime, runtime.engine)  # its requests have failed already
            runtime.engine = None
            self._start_load(runtime)
        elif isinstance(action, Resize):
            runtime = self.models[action.name]
            runtime.config = action.config
            if runtime.engine is not None and runtime.built is not None:  # plan(): loaded
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
                runtime.loading = None
                recurs = isinstance(exc, ModelLoadError) and exc.recurs
                runtime.record_failure(message, time.monotonic(), recurs=recurs)
                kept = "; the previous engine keeps serving" if runtime.engine else ""
                retry = (
                    NOT_RETRIED
                    if recurs
                    else f"retry in {runtime.retry_at - time.monotonic():.0f}s"
                )
                log.error(
                    "model '%s' failed to load%s: %s (%s)", runtime.name, kept, message, retry
                )
                self._publish()
            return
        if runtime.loading is not task or self.models.get(runtime.name) is not runtime:
            await engine.close()  # superseded by a newer reconcile while loading
            return
        self.loads[runtime.name, "ok"] += 1
        previous = runtime.engine
        runtime.engine, runtime.built, runtime.error, runtime.loading = engine, config, None, None
        runtime.restarting, runtime.up_since = False, time.monotonic()
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
        key = share_key(runtime.name, config, self.desired)
        if key is None:
            return await self._start_engine(runtime, config)
        base = config.model_copy(update={"adapter": None})

        async def start() -> AdapterHost:
            return cast(AdapterHost, await self._start_engine(runtime, base))

        return await self.pool.view(runtime.name, config, key, start)

    async def _start_engine(self, runtime: ModelRuntime, config: ModelConfig) -> Engine:
        async def make_room(need: MemoryNeed) -> None:
            await memory_budget.make_room(need, runtime, self.models, self.server, self._park)

        if self.server.workers == "process":
            return await WorkerEngine.start(runtime.name, config, lambda: self.server, make_room)
        if self.start_inline is None:
            raise Unavailable("this process cannot load models inline (server.workers: inline)")
        return await self.start_inline(runtime.name, config, lambda: self.server, make_room)

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
            wait = runtime.retry_at - time.monotonic()
            if runtime.loading is None and runtime.gave_up:
                raise ModelLoadError(f"model '{name}' cannot load: {runtime.error} ({NOT_RETRIED})")
            if runtime.loading is None and runtime.error is not None and wait > 0:
                raise Unavailable(
                    f"model '{name}' failed ({runtime.error}); next try in {wait:.0f}s",
                    headers={"Retry-After": str(max(int(wait), 1))},
                )
            loading = runtime.loading or self._start_load(runtime)
            self._publish()
            try:
                # (asyncio.timeout: 3.11's wait_for drops a cancel landing as the load ends.)
                async with asyncio.timeout(deadline - time.monotonic()):
                    await asyncio.shield(loading)
            except TimeoutError:
                raise Unavailable(
                    f"model '{name}' is still loading after {self.server.load_timeout:.0f}s "
                    "(server.load_timeout); retry shortly",
                    headers={"Retry-After": "5"},
                ) from None
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not loading.cancelled() or (task is not None and task.cancelling()):
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
        if runtime.engine is not None:
            log.info("model '%s' unloaded on demand", name)
        await self._park(runtime)

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

    def _park(self, runtime: ModelRuntime) -> asyncio.Future:
        """Close the model's engine once idle; it stays declared and routable (parked), and
        its next request loads it again. Awaitable: done once the engine has closed."""
        runtime.parked = True
        engine, runtime.engine = runtime.engine, None
        self._publish()
        if engine is None:
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        return self._retire(runtime, engine)

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

    async def refresh_stats(self) -> None:
        """Bring every serving engine's `stats()` up to date (workers are asked at once)."""
        engines = [rt.engine for rt in self.models.values() if rt.engine is not None]
        await asyncio.gather(*(engine.refresh_stats() for engine in engines))

    def status(self) -> dict[str, dict]:
        """Per model: state, aliases, error, draining engines and the serving engine's stats."""
        return status_report(self.models.values(), self.removed)
