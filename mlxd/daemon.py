"""The running daemon: the desired `Registry`, the engines that serve it, and the routes."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from mlxd.config import ModelConfig, Registry
from mlxd.engines.base import Engine
from mlxd.engines.llm import LLMEngine
from mlxd.errors import MlxdError
from mlxd.registry.routes import ModelEntry, RouteTable

log = logging.getLogger("mlxd")

ENGINES: Mapping[str, type] = {"llm": LLMEngine}


class Daemon:
    def __init__(self, registry: Registry):
        self.registry = registry
        self.routes = RouteTable()
        self.started_at = time.time()
        self.ready = False

    async def start(self) -> None:
        """Load every eager model; a model that fails is marked failed, the rest still serve."""
        entries = {
            name: ModelEntry(name, config, "loading")
            for name, config in self.registry.models.items()
        }
        self.routes = RouteTable(dict(entries))
        for name, config in self.registry.models.items():
            entries[name] = await self._load(name, config)
            self.routes = RouteTable(dict(entries))
        self.ready = True

    async def _load(self, name: str, config: ModelConfig) -> ModelEntry:
        engine_cls = ENGINES.get(config.kind)
        if engine_cls is None:
            error = f"kind '{config.kind}' is not supported yet"
            log.error("model '%s': %s", name, error)
            return ModelEntry(name, config, "failed", error=error)
        started = time.monotonic()
        try:
            engine: Engine = await engine_cls.load(name, config, self.registry.server.cache_dir)
        except MlxdError as exc:
            log.error("model '%s' failed to load: %s", name, exc.message)
            return ModelEntry(name, config, "failed", error=exc.message)
        except Exception as exc:  # an unexpected loader bug must not take the daemon down
            log.exception("model '%s' failed to load", name)
            return ModelEntry(name, config, "failed", error=repr(exc))
        stats = engine.stats()
        log.info(
            "model '%s' loaded in %.1fs (%s, %s, %.0f MB)",
            name,
            time.monotonic() - started,
            config.kind,
            stats.get("dtype"),
            stats.get("weights_bytes", 0) / 1e6,
        )
        return ModelEntry(name, config, "loaded", engine=engine)

    async def close(self) -> None:
        for entry in self.routes.models.values():
            if entry.engine is not None:
                await entry.engine.close()
