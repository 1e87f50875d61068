"""Operational endpoints: /health (liveness + readiness) and /v1/status (what runs where)."""

from __future__ import annotations

import time
from typing import Any

from quart import Blueprint, current_app

from mlxd import accel

blueprint = Blueprint("admin", __name__)


@blueprint.get("/health")
async def health() -> Any:
    daemon = current_app.daemon
    states = {name: entry.state for name, entry in daemon.routes.models.items()}
    if not daemon.ready:
        status, code = "starting", 503
    elif any(state == "failed" for state in states.values()):
        status, code = "degraded", 200
    else:
        status, code = "ok", 200
    return {"status": status, "models": states}, code


@blueprint.get("/v1/status")
async def status() -> Any:
    daemon = current_app.daemon
    models = {}
    for name, entry in daemon.routes.models.items():
        models[name] = {
            "state": entry.state,
            "kind": entry.config.kind,
            "aliases": list(entry.config.aliases),
            "error": entry.error,
            **(entry.engine.stats() if entry.engine is not None else {}),
        }
    return {
        "uptime_s": round(time.time() - daemon.started_at, 1),
        "platform": accel.describe(),
        "models": models,
    }
