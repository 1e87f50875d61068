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

    def entry(self, model_id: str) -> ModelEntry:
        name = self.ids.get(model_id)
        if name is None:
            available = ", ".join(sorted(self.ids)) or "none"
            raise NotFound(
                f"model '{model_id}' does not exist; available models: {available}",
                param="model",
            )
        return self.models[name]
