"""The route table: which engine answers a `model` id. Immutable; replaced whole, atomically."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from mlxd.config import ModelConfig
from mlxd.errors import NotFound
from mlxd.runtime.engine import Engine

ModelState = Literal["loading", "loaded", "unloaded", "failed", "restarting"]

# Routing-level settings (aliases, defaults, keys) live on the entry, not in the engine, so
# changing them never touches an engine.


@dataclass(frozen=True)
class Caller:
    """Who sent a request: `admin` holds a server key (or the daemon is open); `models` are
    the model names the key may use (None: every model)."""

    admin: bool
    models: frozenset[str] | None = None

    def may_use(self, name: str) -> bool:
        return self.models is None or name in self.models


OPEN = Caller(admin=True)
"""A server key, an open daemon, or the daemon itself."""


@dataclass(frozen=True)
class ModelEntry:
    name: str
    config: ModelConfig
    state: ModelState
    engine: Engine | None = None
    error: str | None = None


@dataclass(frozen=True)
class RouteTable:
    models: Mapping[str, ModelEntry] = field(default_factory=dict)

    @property
    def ids(self) -> dict[str, str]:
        """Every id a client may send (names and aliases) → model name."""
        ids = {name: name for name in self.models}
        for entry in self.models.values():
            ids.update({alias: entry.name for alias in entry.config.aliases})
        return ids

    def name_of(self, model_id: str) -> str | None:
        """The model `model_id` names, as every dialect's clients may write it: a name, an
        alias, either with Ollama's tag `:latest`. Says nothing of who may use it."""
        ids = self.ids
        return ids.get(model_id) or ids.get(model_id.removesuffix(":latest"))

    def entry(self, model_id: str, caller: Caller) -> ModelEntry:
        """The model `model_id` names, if `caller` may use it. Ollama's tag `:latest` on a
        known id is the id (every dialect's clients may send it). A model the caller may not
        use does not exist for it: the same 404 as an unknown id, listing only its own."""
        ids = self.ids
        name = self.name_of(model_id)
        if name is None or not caller.may_use(name):
            mine = sorted(i for i, n in ids.items() if caller.may_use(n))
            raise NotFound(
                f"model {model_id!r} does not exist; available models: "
                + (", ".join(mine) or "none"),
                param="model",
            )
        return self.models[name]
