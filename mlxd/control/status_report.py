"""The report of `/v1/status` (and what `/metrics` and Ollama's model lists read): per
declared model its state, settings, failures and idleness, and the serving engine's stats."""

from __future__ import annotations

import time
from collections.abc import Iterable

from mlxd.control.model_runtime import ModelRuntime


def status_report(
    models: Iterable[ModelRuntime], removed_models: list[ModelRuntime]
) -> dict[str, dict]:
    """Per model: state, aliases, error, draining engines and the serving engine's stats."""
    rows = {}
    now = time.monotonic()
    for runtime in [*models, *removed_models]:
        removed = runtime in removed_models
        engine = runtime.engine
        rows[runtime.name] = {
            "state": "draining" if removed else runtime.state,
            "kind": runtime.config.kind,
            "source": runtime.config.source,
            "adapter": str(runtime.config.adapter) if runtime.config.adapter else None,
            "load": runtime.config.load,
            "aliases": [] if removed else list(runtime.config.aliases),
            "error": runtime.error,
            "draining": len(runtime.draining),
            "restarts": runtime.restarts,
            # Failures in a row (deaths, failed loads) and when the next try is due.
            "failures": runtime.failures,
            "next_retry_s": (
                round(max(runtime.retry_at - now, 0.0), 1)
                if runtime.error and not runtime.gave_up
                else None
            ),
            # The error recurs with these files and config: retried once either changes.
            "gave_up": runtime.gave_up,
            # idle_ttl in force (YAML or a client's keep_alive); null: never unloaded idle.
            "idle_ttl_s": runtime.idle_ttl,
            "idle_s": round(now - engine.last_used, 1) if engine and engine.idle else 0.0,
            **(runtime.engine.stats() if runtime.engine is not None else {}),
        }
    return rows
