"""Reconcile planning: the actions that turn the running models into the configured ones.

Pure: it compares configs and observed facts and returns a list of actions; executing them
(loading engines, draining, flipping routes) is the caller's job, which keeps every decision
testable. Like a controller-runtime `Reconcile`, it runs again on every config change and on a
periodic tick, so lifecycle facts (a dead worker, an engine idle past its TTL, a backoff that
has run out) become actions the same way a YAML edit does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from mlxd.config import ModelConfig

# Changing any of these needs a new engine; the rest only changes how requests reach it.
ENGINE_FIELDS = (
    "kind",
    "source",
    "adapter",
    "dtype",
    "cpu_activations",
    "batch",
    "cache",
    "context_length",
    "max_prompt_tokens",
    "distributed",
    "speculative",
    "audio",  # a speech model's worker reads audio.voice: a change needs a new engine
)
ROUTING_FIELDS = (
    "aliases",
    "api_keys",
    "defaults",
    "parsers",
    "load",
    "idle_ttl",
    # Embedding requests read these from the route entry: no new engine needed.
    "truncate",
    "max_inputs",
    # Merged into each request at the API edge (api/common/generation.py `template_kwargs`).
    "chat_template_kwargs",
    "rate_limit",  # read from the route entry per request (api/middleware/ratelimit.py)
    "stream_interval",  # applied to the event stream at the API edge (api/common/event_flow.py)
    "warm_up",  # what a load runs before it serves: the next load reads it, no new engine
)
# Cache settings a loaded engine can take in place; the others change what a block holds.
CACHE_BUDGET_FIELDS = ("ram", "ssd", "ssd_ttl")
_ALL = ENGINE_FIELDS + ROUTING_FIELDS
# Secrets: a log line says that they changed, never what to.
_SECRET_FIELDS = frozenset({"api_keys"})

State = Literal["loaded", "loading", "unloaded", "parked", "failed", "dead"]
"""A model's engine right now. "unloaded": a lazy model with no engine; "parked": unloaded on
demand or for idleness, declared still, loaded again by its next request; "failed": its last
load failed; "dead": its worker died (its requests have failed; a restart is due)."""

# Restart backoff: 1 s, 2 s, 4 s … doubling up to this, while a model keeps failing.
MAX_BACKOFF_S = 60.0


def backoff(failures: int) -> float:
    """Seconds to wait before retrying a model that failed `failures` times in a row."""
    return min(MAX_BACKOFF_S, 2.0 ** max(failures - 1, 0))


@dataclass(frozen=True)
class Actual:
    """What runs under a name: the config its engine runs (or is loading) with, its state, and
    the lifecycle facts plan() decides on."""

    config: ModelConfig
    state: State
    # Seconds a loaded engine has been idle (None: busy), and the idle TTL in force (the YAML
    # idle_ttl or a client's keep-alive; None: never unloaded for idleness).
    idle_for: float | None = None
    idle_ttl: float | None = None
    # failed / dead: seconds until the retry backoff has run out (<= 0: retry now).
    retry_in: float = 0.0


# `changes` on the actions below is for describe() only, so it takes no part in equality.


@dataclass(frozen=True)
class Load:
    """Start an eager model or register a lazy one; also retries a failed one."""

    name: str
    config: ModelConfig


@dataclass(frozen=True)
class Unload:
    """Drain, then close the engine; the route goes away."""

    name: str


@dataclass(frozen=True)
class Park:
    """Idle past its TTL: drain and close the engine; the model stays routable and its next
    request loads it again."""

    name: str


@dataclass(frozen=True)
class Restart:
    """The worker died: load the model again in a fresh one (its backoff has run out)."""

    name: str
    config: ModelConfig


@dataclass(frozen=True)
class Swap:
    """Engine-level change: a new engine loads beside the old one; the route flips when ready."""

    name: str
    config: ModelConfig
    changes: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class Retarget:
    """Routing-level change only (or any change to a lazy model with no engine): no engine work."""

    name: str
    config: ModelConfig
    changes: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class Resize:
    """Only cache budgets changed on a loaded engine: resize its cache, keep its weights."""

    name: str
    config: ModelConfig
    changes: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class Rename:
    """A loaded engine moves to a new name as is, instead of reloading the same weights."""

    old: str
    new: str
    config: ModelConfig


Action = Load | Unload | Park | Restart | Swap | Retarget | Resize | Rename


def engine_settings(config: ModelConfig) -> tuple[Any, ...]:
    """The values of ENGINE_FIELDS: two configs with equal settings can share one engine."""
    return tuple(getattr(config, name) for name in ENGINE_FIELDS)


def _only_cache_budgets_differ(new: ModelConfig, old: ModelConfig) -> bool:
    budgets = {name: getattr(old.cache, name) for name in CACHE_BUDGET_FIELDS}
    same_budgets = new.model_copy(update={"cache": new.cache.model_copy(update=budgets)})
    return engine_settings(same_budgets) == engine_settings(old)


def _routing_settings(config: ModelConfig) -> tuple[Any, ...]:
    return tuple(getattr(config, name) for name in ROUTING_FIELDS)


def plan(desired: Mapping[str, ModelConfig], actual: Mapping[str, Actual]) -> list[Action]:
    """The actions that take `actual` to `desired`, in the order they should run.

    Unloads and parks come first so their memory is freed before anything loads, then
    renames, retargets, resizes, swaps, restarts and loads. Within a kind, names follow
    `desired`'s order (removals follow `actual`'s), so the same inputs always give the same
    plan.
    """
    removed = [name for name in actual if name not in desired]
    # Only a loaded engine can move; a loading, failed or engine-less one is cheaper to redo.
    movable = [name for name in removed if actual[name].state == "loaded"]

    renames: list[Rename] = []
    parks: list[Park] = []
    restarts: list[Restart] = []
    retargets: list[Retarget] = []
    resizes: list[Resize] = []
    swaps: list[Swap] = []
    loads: list[Load] = []
    for name, config in desired.items():
        current = actual.get(name)
        if current is None:
            settings = engine_settings(config)
            old = next((o for o in movable if engine_settings(actual[o].config) == settings), None)
            if old is None:
                loads.append(Load(name, config))
            else:
                movable.remove(old)
                renames.append(Rename(old, name, config))
        elif current.state == "failed":
            # Retried once its backoff runs out (a config change retries at once): the weights
            # may have been fixed without a YAML change.
            if current.retry_in <= 0:
                loads.append(Load(name, config))
        elif current.state == "dead":
            if current.retry_in <= 0:
                restarts.append(Restart(name, config))
            if config != current.config:
                retargets.append(Retarget(name, config, _diff(current.config, config, _ALL)))
        elif _idle_expired(current):
            parks.append(Park(name))
            if config != current.config:  # the next load takes the new settings
                retargets.append(Retarget(name, config, _diff(current.config, config, _ALL)))
        elif current.state in ("unloaded", "parked"):
            if config.load == "eager" and current.state == "unloaded":
                loads.append(Load(name, config))
            elif config != current.config:
                retargets.append(Retarget(name, config, _diff(current.config, config, _ALL)))
        else:
            if engine_settings(config) != engine_settings(current.config):
                changes = _diff(current.config, config, ENGINE_FIELDS)
                in_place = current.state == "loaded"
                if in_place and _only_cache_budgets_differ(config, current.config):
                    resizes.append(Resize(name, config, changes))
                else:
                    swaps.append(Swap(name, config, changes))
            # Also while a swap loads, so new aliases and defaults apply at once.
            if _routing_settings(config) != _routing_settings(current.config):
                changes = _diff(current.config, config, ROUTING_FIELDS)
                retargets.append(Retarget(name, config, changes))

    renamed = {rename.old for rename in renames}
    unloads = [Unload(name) for name in removed if name not in renamed]
    return [*unloads, *parks, *renames, *retargets, *resizes, *swaps, *restarts, *loads]


def _idle_expired(current: Actual) -> bool:
    return (
        current.state == "loaded"
        and current.idle_ttl is not None
        and current.idle_for is not None
        and current.idle_for >= current.idle_ttl
    )


@dataclass(frozen=True)
class Resident:
    """A loaded engine the memory budget may evict: its name, bytes, and whether it is idle."""

    name: str
    memory_bytes: int
    last_used: float
    idle: bool


def evictions(need: int, budget: int | None, residents: list[Resident]) -> list[str] | None:
    """The idle engines to unload, least recently used first, so that `need` more bytes fit
    `budget`; None when even evicting every idle one is not enough."""
    if budget is None:
        return []
    in_use = sum(r.memory_bytes for r in residents)
    chosen: list[str] = []
    for resident in sorted((r for r in residents if r.idle), key=lambda r: r.last_used):
        if in_use + need <= budget:
            break
        chosen.append(resident.name)
        in_use -= resident.memory_bytes
    return chosen if in_use + need <= budget else None


def _diff(
    old: BaseModel, new: BaseModel, fields: tuple[str, ...], prefix: str = ""
) -> tuple[str, ...]:
    """Readable `field old -> new` items, down to the changed keys of nested sections."""
    changes: list[str] = []
    for name in fields:
        before, after = getattr(old, name), getattr(new, name)
        if before == after:
            continue
        path = prefix + name
        if name in _SECRET_FIELDS:
            changes.append(f"{path} changed")
        elif isinstance(before, BaseModel) and isinstance(after, BaseModel):
            changes.extend(_diff(before, after, tuple(type(before).model_fields), f"{path}."))
        else:
            changes.append(f"{path} {_show(before)} -> {_show(after)}")
    return tuple(changes)


def _show(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def describe(action: Action) -> str:
    """One log line for an action, e.g. "swap 'smol': batch.max_batch_size 32 -> 16"."""
    match action:
        case Load(name, config):
            return f"load {name!r} ({config.load})"
        case Unload(name):
            return f"unload {name!r}"
        case Park(name):
            return f"unload idle {name!r}"
        case Restart(name, _):
            return f"restart {name!r}"
        case Rename(old, new, _):
            return f"rename {old!r} -> {new!r}"
        case Swap(name, _, changes) | Retarget(name, _, changes) | Resize(name, _, changes):
            verb = type(action).__name__.lower()
            return f"{verb} {name!r}: {'; '.join(changes)}" if changes else f"{verb} {name!r}"
