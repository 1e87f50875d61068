"""Which declared models share one engine: those of one source and the same engine settings
but another `adapter:` (LoRA), served by one base engine (runtime/shared_pool.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping

from mlxd.config import ModelConfig
from mlxd.control.plan import ENGINE_FIELDS


def share_key(name: str, config: ModelConfig, desired: Mapping[str, ModelConfig]) -> str | None:
    """The key of the engine `name` shares with the other declared models of its source and
    engine settings, when one of them has another `adapter:` (None: its own engine)."""
    key = _share_group(config)
    if key is None:
        return None
    siblings = [m for n, m in desired.items() if n != name and _share_group(m) == key]
    return key if any(m.adapter != config.adapter for m in siblings) else None


def _share_group(config: ModelConfig) -> str | None:
    """What must match for models to share an engine: every engine field but `adapter`
    (None: a kind or setup that never shares)."""
    if config.kind != "llm" or config.distributed is not None:
        return None
    fields = set(ENGINE_FIELDS) - {"adapter"}
    return json.dumps(config.model_dump(mode="json", include=fields), sort_keys=True)
