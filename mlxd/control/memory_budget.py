"""Making room in `server.memory_budget` before a load: idle models are unloaded, least
recently used first (`plan.evictions`), models that share an engine together."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from mlxd.config import ServerConfig
from mlxd.control.model_runtime import ModelRuntime
from mlxd.control.plan import Resident, evictions
from mlxd.errors import ModelLoadError, Unavailable
from mlxd.memory_need import MemoryNeed, gib
from mlxd.runtime.shared_pool import SharedView

log = logging.getLogger("mlxd.reconcile")


async def make_room(
    need: MemoryNeed,
    loading: ModelRuntime,
    models: dict[str, ModelRuntime],
    server: ServerConfig,
    park: Callable[[ModelRuntime], Awaitable[None]],
) -> None:
    """Unload idle models, least recently used first, until `need` fits the budget. A model
    that could not fit even alone is refused for good (until the config changes)."""
    if refusal := need.over_budget(loading.name, server):
        raise ModelLoadError(refusal)
    budget = server.budget_bytes
    draining = sum(e.memory_bytes for rt in models.values() for e in rt.draining)
    # Models sharing an engine are evicted together: only the last one out frees it.
    groups: dict[str, list[ModelRuntime]] = {}
    for rt in models.values():
        if rt is not loading and rt.engine is not None:
            engine = rt.engine
            key = f"engine {id(engine.base)}" if isinstance(engine, SharedView) else rt.name
            groups.setdefault(key, []).append(rt)
    residents = [
        Resident(
            key,
            sum(rt.engine.memory_bytes for rt in rts if rt.engine),
            max(rt.engine.last_used for rt in rts if rt.engine),
            all(rt.engine.idle for rt in rts if rt.engine),
        )
        for key, rts in groups.items()
    ]
    victims = evictions(need.total + draining, budget, residents)
    if victims is None:
        in_use = draining + sum(r.memory_bytes for r in residents)
        busy = ", ".join(rt.name for rt in models.values() if rt.engine) or "none"
        raise Unavailable(
            f"model '{loading.name}' needs {gib(need.total)} ({need.describe()}) but "
            f"server.memory_budget ({gib(budget)}) has {gib(max(budget - in_use, 0))} "
            f"free; loaded and busy: {busy}"
        )
    for key in victims:
        for rt in groups[key]:
            log.info("memory budget: unloading idle model '%s' to make room", rt.name)
        # Idle, so they close at once; the memory is back once their worker has exited.
        await asyncio.gather(*(park(rt) for rt in groups[key]))
