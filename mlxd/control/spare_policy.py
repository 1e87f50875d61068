"""When the daemon keeps a worker imported ahead of the next load (runtime/spare_worker.py).

A worker spends about 1.3 s importing MLX, mlx-lm and transformers before it reads a model: a
lazy model's first request, a parked model's next one and a failed load's retry each waited for
that on top of the load itself (a cached Llama-3.2-1B shape answered a lazy model's first
request in 2.45 s, 0.72–0.80 s with a worker ready; SmolLM2 3.0 s against 0.57–0.63). So
while some declared model could still need a worker, one is kept ready: spawned once the
daemon is quiet (no load running, every engine idle for `QUIET_S`), so that its imports take a
core no request is using, and ended once no model could take it. It costs about 105 MiB while
it waits, which `server.memory_budget` counts: a spare is kept only where the budget has room
for it beside the models' engines (a budget the models fill takes none).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

from mlxd.config import ServerConfig
from mlxd.control.model_runtime import ModelRuntime

QUIET_S = 3.0
# What a waiting spare holds (≈105 MiB measured: Python with MLX, mlx-lm and transformers
# imported), with some margin.
SPARE_BYTES = 128 * 2**20

Want = Literal["spawn", "discard", "keep"]


def _waits(runtime: ModelRuntime) -> bool:
    """Whether this model's next load would start a worker: not loaded (or its worker dead,
    to be restarted), not loading, not given up on, and not distributed (its ranks start their
    own processes)."""
    return (
        (runtime.engine is None or runtime.dead())
        and runtime.loading is None
        and not runtime.gave_up
        and runtime.config.distributed is None
    )


def _quiet(runtime: ModelRuntime, now: float) -> bool:
    """Whether no request has run on this model's engines (serving or draining) for QUIET_S."""
    engines = [*runtime.draining, *([runtime.engine] if runtime.engine is not None else [])]
    return all(engine.idle and now - engine.last_used >= QUIET_S for engine in engines)


def _engine_bytes(runtimes: Iterable[ModelRuntime]) -> int:
    """What the budget counts for these models' engines, serving and draining; a dead one's
    worker has exited (its restart may take the spare)."""
    return sum(
        engine.memory_bytes
        for runtime in runtimes
        for engine in [*runtime.draining, *([runtime.engine] if runtime.engine else [])]
        if engine.failure is None
    )


def spare_wanted(
    models: Iterable[ModelRuntime],
    server: ServerConfig,
    now: float,
    *,
    removed: Iterable[ModelRuntime] = (),
    joins: Callable[[ModelRuntime], bool] = lambda runtime: False,
) -> Want:
    """What to do with the spare: spawn one (where none is alive), discard it, or keep things as
    they are (a load running may still take it, or requests are running). `removed`: models a
    reload removed whose engines still drain (busy or not, they take no worker); `joins`:
    whether a model's load would join an engine already running (a LoRA adapter's shared base)
    instead of starting a worker."""
    runtimes, removed = list(models), list(removed)
    if server.workers != "process":
        return "discard"
    if any(runtime.loading is not None for runtime in runtimes):
        return "keep"
    if not any(_waits(runtime) and not joins(runtime) for runtime in runtimes):
        return "discard"
    if _engine_bytes([*runtimes, *removed]) + SPARE_BYTES > server.budget_bytes:
        return "discard"  # no room beside the engines: the next load spawns its own worker
    quiet = all(_quiet(runtime, now) for runtime in [*runtimes, *removed])
    return "spawn" if quiet else "keep"
