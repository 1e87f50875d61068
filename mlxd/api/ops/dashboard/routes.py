"""`/` serves the dashboard page; `/dashboard/api/*` the state behind it.

The state is `/v1/status` (the same function computes it) plus what only the page needs: the
memory budget, the last reconcile's actions, 15 minutes of samples and the request log. The
JSON endpoints sit behind the admin key like `/v1/status` (see `auth.ADMIN_PREFIXES`); the page
and its static files load without one, so `/` also answers clients that probe it for liveness.
`server.dashboard: false` turns all of it into 404s (read per request: it follows reloads).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from importlib.resources import files
from typing import Any

from quart import Blueprint, Response, request, stream_with_context

from mlxd.api.common.context import App, current_app
from mlxd.api.ops import admin
from mlxd.api.ops.dashboard.history import History, RequestLog, Sample
from mlxd.api.ops.metrics import Metrics
from mlxd.errors import NotFound

log = logging.getLogger("mlxd.dashboard")

blueprint = Blueprint("dashboard", __name__)
STATIC = files("mlxd.api.ops.dashboard") / "static"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
EVENT_INTERVAL_S = 2.0
CHANGE_POLL_S = 0.2


def install(app: App, metrics: Metrics) -> None:
    """Keep the history and request log for `app`, and sample while it serves."""
    history, requests = History(), RequestLog()
    app.extensions["mlxd_dashboard"] = (history, requests)
    metrics.listeners.append(lambda fields: requests.add(fields, time.time()))

    @app.before_serving
    async def start_sampling() -> None:
        app.extensions["mlxd_dashboard_sampler"] = asyncio.create_task(_sample(app, history))

    @app.after_serving
    async def stop_sampling() -> None:
        app.extensions["mlxd_dashboard_sampler"].cancel()


async def _sample(app: App, history: History) -> None:
    metrics: Metrics = app.extensions["mlxd_metrics"]
    while True:
        try:
            if not app.daemon.config.server.dashboard:  # off: nobody will look
                await asyncio.sleep(history.interval_s)
                continue
            async with app.app_context():
                status = await admin.status()
            now = time.time()
            for name, row in status["models"].items():
                rate = metrics.rate(name, history.interval_s, now)
                history.add(name, Sample(now, rate, row["queue_depth"], row["running"]))
        except Exception:  # a bad sample must not end the sampling
            log.exception("dashboard sample failed")
        await asyncio.sleep(history.interval_s)


@blueprint.before_request
async def enabled() -> None:
    if not current_app.daemon.config.server.dashboard:
        raise NotFound(f"no route for {request.method} {request.path} (server.dashboard: false)")


@blueprint.get("/")
async def page() -> Any:
    return _static("index.html")


@blueprint.get("/dashboard/static/<path:filename>")
async def static(filename: str) -> Any:
    return _static(filename)


def _static(filename: str) -> Response:
    # Only the files shipped in static/, by plain name: no path can climb out of it.
    names = {entry.name for entry in STATIC.iterdir()}
    if filename not in names:
        raise NotFound(f"no dashboard file {filename!r}")
    suffix = filename[filename.rfind(".") :]
    body = (STATIC / filename).read_bytes()
    response = Response(body, content_type=CONTENT_TYPES.get(suffix, "application/octet-stream"))
    response.headers["Cache-Control"] = "no-cache"  # an upgrade must not keep the old script
    return response


async def _state(model: str | None) -> dict[str, Any]:
    daemon = current_app.daemon
    history, requests = current_app.extensions["mlxd_dashboard"]
    status = await admin.status()
    status["config"]["last_actions"] = daemon.last_actions
    status["memory_budget"] = daemon.config.server.budget_bytes
    return {
        "status": status,
        "history": {"interval_s": history.interval_s, "models": history.series(time.time())},
        "requests": requests.lines(model),
    }


@blueprint.get("/dashboard/api/state")
async def state() -> Any:
    """Everything the page shows; `?model=NAME` keeps only that model's request log lines."""
    return await _state(request.args.get("model") or None)


@blueprint.get("/dashboard/api/events")
async def events() -> Any:
    """Server-sent events: the state every 2 s, and at once when a model or the config
    changes, until the client leaves or the daemon drains."""
    model = request.args.get("model") or None
    daemon = current_app.daemon

    def version() -> tuple[Any, ...]:
        # Changes when a model changes state (every change publishes a new route table) or a
        # config is applied or rejected: sent at once rather than at the next tick. The table
        # itself is held, so `is` cannot be fooled by a reused id.
        config = daemon.config_status
        return (daemon.routes, config.generation, config.last_error)

    def changed(sent: tuple[Any, ...]) -> bool:
        now = version()
        return now[0] is not sent[0] or now[1:] != sent[1:]

    @stream_with_context  # the state reads the app
    async def stream() -> AsyncIterator[bytes]:
        while not daemon.draining:
            sent = version()
            body = json.dumps(await _state(model), separators=(",", ":"))
            yield f"event: state\ndata: {body}\n\n".encode()
            deadline = time.monotonic() + EVENT_INTERVAL_S
            while time.monotonic() < deadline and not changed(sent) and not daemon.draining:
                await asyncio.sleep(CHANGE_POLL_S)

    response = Response(stream(), content_type="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.timeout = None  # open as long as the page is
    return response
