"""The running daemon: the config file, the reconciler that serves it, and the live routes."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import psutil

from mlxd.config import Config, load_config
from mlxd.control.plan import Action, describe
from mlxd.control.reconciler import Reconciler
from mlxd.control.routes import Caller, RouteTable
from mlxd.errors import ConfigError, Forbidden
from mlxd.runtime.engine import Engine, EngineStarter

log = logging.getLogger("mlxd")

# How often lifecycle facts (deaths, idleness, ended backoffs) are reconciled.
TICK_S = 1.0
# Server settings a reload cannot change in a running daemon (its sockets, its workers' kind, its
# caches' place): they keep their value until a restart.
RESTART_ONLY = ("host", "port", "ollama_port", "cache_dir", "workers")


@dataclass
class ConfigStatus:
    generation: int = 0
    loaded_at: float | None = None
    last_error: str | None = None


@dataclass(frozen=True)
class DaemonFootprint:
    """What the daemon itself costs, taken when it starts serving, before any model loads
    (models run in worker processes of their own: these stay the daemon's figures)."""

    pid: int
    startup_s: float  # from the process's start (a BLAS re-exec included) to serving
    rss_bytes: int

    @classmethod
    def measure(cls) -> DaemonFootprint:
        process = psutil.Process()
        return cls(process.pid, round(_seconds_since_start(process), 2), process.memory_info().rss)


def _seconds_since_start(process: psutil.Process) -> float:
    """Since the process started, to the clock tick: psutil's `create_time` adds the boot time,
    which Linux gives in whole seconds (a start measured 0.6 s took up to 1.6 s)."""
    try:
        # Field 22 of /proc/<pid>/stat (after the parenthesised name): clock ticks since boot.
        stat = Path(f"/proc/{process.pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        return time.time() - process.create_time()


class Daemon:
    def __init__(
        self,
        config: Config,
        config_path: Path | None = None,
        start_inline: EngineStarter | None = None,
    ):
        self.config = config
        self.config_path = config_path
        self.config_status = ConfigStatus()
        self.routes = RouteTable()
        self.started_at = time.time()
        self.footprint: DaemonFootprint | None = None  # set when serving starts
        self.ready = False
        self.draining = False  # shutting down: new requests get 503
        self.reloads: Counter[str] = Counter()  # by outcome: applied | rejected
        self.last_actions: list[str] = []  # the last reconcile's actions, described (dashboard)
        self.reconciler = Reconciler(config.server, self._set_routes, start_inline)
        self._reload_lock = asyncio.Lock()
        self._ticker: asyncio.Task | None = None

    def _set_routes(self, routes: RouteTable) -> None:
        self.routes = routes  # one assignment: readers see the old table or the new one

    async def start(self) -> None:
        """Reconcile the initial config and wait for its eager models (failures are kept)."""
        self._apply(self.config)
        self._ticker = asyncio.create_task(self._tick())
        loads = [rt.loading for rt in self.reconciler.models.values() if rt.loading]
        await asyncio.gather(*loads, return_exceptions=True)
        self.ready = True

    async def reload(self) -> list[Action]:
        """Re-read the config file and converge on it. A file that fails to parse or validate
        is rejected whole (ConfigError): what runs keeps running."""
        if self.config_path is None:
            raise ConfigError("the daemon was started without a config file: nothing to reload")
        async with self._reload_lock:
            try:
                config = await asyncio.to_thread(load_config, self.config_path)
            except ConfigError as exc:
                self.reloads["rejected"] += 1
                self.config_status.last_error = exc.message
                log.error(
                    "config rejected, still serving generation %d:\n%s",
                    self.config_status.generation,
                    exc.message,
                )
                raise
            running = {}
            for key in RESTART_ONLY:
                if getattr(config.server, key) != getattr(self.config.server, key):
                    log.warning("server.%s changed: takes effect after a restart", key)
                running[key] = getattr(self.config.server, key)
            # Until then, loads keep what the daemon runs with (where workers and caches are).
            server = config.server.model_copy(update=running)
            self.reloads["applied"] += 1
            return self._apply(config.model_copy(update={"server": server}))

    def _apply(self, config: Config) -> list[Action]:
        self.config = config
        actions = self.reconciler.apply(config.models, config.server)
        self.last_actions = [describe(action) for action in actions]
        self.config_status.generation += 1
        self.config_status.loaded_at = time.time()
        self.config_status.last_error = None
        if not actions:
            log.info("reconcile: generation %d, nothing to change", self.config_status.generation)
        return actions

    # Each takes the caller: a model id is resolved, and authorized, in one place
    # (`RouteTable.entry`), whichever route names it.

    async def engine(self, model_id: str, caller: Caller) -> Engine:
        """The engine serving `model_id` (a name or alias); waits for a lazy or loading one."""
        entry = self.routes.entry(model_id, caller)
        return entry.engine or await self.reconciler.engine_for(entry.name)

    async def load_model(self, model_id: str, caller: Caller) -> None:
        """Load `model_id` (a name or alias) now; it stays declared as it is in the YAML."""
        await self.reconciler.load_now(self.routes.entry(model_id, caller).name)

    async def unload_model(self, model_id: str, caller: Caller) -> None:
        """Unload `model_id` now, once its requests finish; its next request loads it again.
        It is unloaded for everyone: only a server key may (or anyone on an open daemon)."""
        name = self.routes.entry(model_id, caller).name
        if not caller.admin:
            raise Forbidden("unloading a model needs a server key (server.api_keys)")
        await self.reconciler.unload_now(name)

    def set_keep_alive(self, model_id: str, caller: Caller, seconds: float | None) -> None:
        """A client's keep-alive for `model_id`: idle seconds before it unloads (math.inf:
        never), over its YAML idle_ttl. Never written to the YAML. It holds the model for
        everyone: only a server key may set it."""
        name = self.routes.entry(model_id, caller).name
        if caller.admin:
            self.reconciler.set_keep_alive(name, seconds)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.reconciler.tick()
                if not self.draining:  # a worker for a next load that will not come
                    self.reconciler.keep_spare()
            except Exception:  # the next tick tries again; a dead ticker would stop restarts
                log.exception("reconcile tick failed")

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        await self.reconciler.close()
