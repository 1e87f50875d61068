"""Operational endpoints: /health, /v1/status (what runs where), /metrics, /admin/reload."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import psutil
from quart import Blueprint, Response

from mlxd import accel
from mlxd.api.common.context import current_app
from mlxd.api.middleware.auth import keys_required
from mlxd.api.ops.metrics import CONTENT_TYPE
from mlxd.control.plan import describe
from mlxd.control.routes import OPEN  # /admin/ needs a server key (middleware/auth.py)
from mlxd.runtime import spare_worker
from mlxd.runtime.worker_process import process_handle

blueprint = Blueprint("admin", __name__)


def _config_status() -> dict[str, Any]:
    config = current_app.daemon.config_status
    return {
        "generation": config.generation,
        "loaded_at": config.loaded_at,
        "last_error": config.last_error,
    }


@blueprint.get("/health")
async def health() -> Any:
    daemon = current_app.daemon
    # Live runtime states: an engine whose thread just died is "restarting" before the route
    # table is next published.
    states = {name: runtime.state for name, runtime in daemon.reconciler.models.items()}
    if daemon.draining:
        status, code = "draining", 503
    elif not daemon.ready:
        status, code = "starting", 503
    elif (
        any(s in ("failed", "restarting") for s in states.values())
        or daemon.config_status.last_error
    ):
        status, code = "degraded", 200
    else:
        status, code = "ok", 200
    if keys_required(daemon.config):  # open to probes: with keys set, it tells only that
        return {"status": status}, code
    return {"status": status, "models": states, "config": _config_status()}, code


@blueprint.get("/v1/status")
async def status() -> Any:
    daemon = current_app.daemon
    await daemon.reconciler.refresh_stats()
    models = daemon.reconciler.status()
    return {
        "uptime_s": round(time.time() - daemon.started_at, 1),
        "platform": accel.describe(),  # the compute backend and BLAS in use
        "daemon": asdict(daemon.footprint) if daemon.footprint else None,
        "config": {**_config_status(), "path": str(daemon.config_path)},
        "models": {name: _model_status(name, row) for name, row in models.items()},
        "spare_worker": _spare_status(),
    }


def _spare_status() -> dict[str, Any] | None:
    """The worker waiting for the next load (runtime/spare_worker.py), if one is."""
    pid = spare_worker.pid()
    handle = process_handle(pid) if pid is not None else None
    if handle is None:
        return None
    try:
        return {"pid": pid, "rss_bytes": handle.memory_info().rss}
    except psutil.Error:  # ended since
        return None


def _model_status(name: str, row: dict[str, Any]) -> dict[str, Any]:
    """The reconciler's view of a model plus live figures: queue, recent throughput and TTFT."""
    return {
        **row,
        "queue_depth": row.get("waiting", 0),
        "running": row.get("running", 0),
        "memory_bytes": row.get("memory_bytes"),
        "cache": row.get("cache"),
        **current_app.extensions["mlxd_metrics"].summary(name),
    }


@blueprint.get("/metrics")
async def metrics() -> Any:
    """Prometheus text format."""
    await current_app.daemon.reconciler.refresh_stats()
    body = current_app.extensions["mlxd_metrics"].render()
    return Response(body, content_type=CONTENT_TYPE)


@blueprint.post("/admin/models/<path:model>/load")
async def load_model(model: str) -> Any:
    """Load a declared model now (name or alias), through the reconciler."""
    await current_app.daemon.load_model(model, OPEN)
    return _model_state(model)


@blueprint.post("/admin/models/<path:model>/unload")
async def unload_model(model: str) -> Any:
    """Unload a model now; it stays declared and its next request loads it again."""
    await current_app.daemon.unload_model(model, OPEN)
    return _model_state(model)


def _model_state(model_id: str) -> dict[str, str]:
    daemon = current_app.daemon
    name = daemon.routes.entry(model_id, OPEN).name
    return {"model": name, "state": daemon.reconciler.models[name].state}


@blueprint.post("/admin/reload")
async def reload() -> Any:
    """Re-read the config file now. An invalid file is a 400 and changes nothing."""
    actions = await current_app.daemon.reload()
    return {"config": _config_status(), "actions": [describe(a) for a in actions]}
