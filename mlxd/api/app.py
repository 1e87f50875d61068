"""The Quart app and its hypercorn server."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig
from quart import request
from quart.typing import ResponseReturnValue
from werkzeug.exceptions import HTTPException

from mlxd.api.common import dialect
from mlxd.api.common.context import App
from mlxd.api.middleware import auth, browser, observe, ratelimit
from mlxd.api.middleware import drain as shutdown
from mlxd.api.openai import audio
from mlxd.api.ops import dashboard
from mlxd.api.ops.metrics import Metrics
from mlxd.control.watcher import reload_on_sighup, watch_config
from mlxd.daemon import Daemon, DaemonFootprint
from mlxd.errors import InvalidRequest, MlxdError, NotFound, RequestTooLarge

log = logging.getLogger("mlxd.api")

# Generous: a burst of clients must queue in the kernel, not be reset (mlx_lm.server uses 5).
LISTEN_BACKLOG = 2048


def create_app(daemon: Daemon) -> App:
    app = App("mlxd")
    app.daemon = daemon
    server = daemon.config.server
    app.config.update(
        RESPONSE_TIMEOUT=None,  # generations are bounded by max_tokens, not wall time
        BODY_TIMEOUT=60,
        MAX_CONTENT_LENGTH=server.max_request_bytes,
    )
    app.inflight = shutdown.install(app)
    browser.install(app)  # before auth: a refused page learns nothing about keys
    audio.install(app)  # audio uploads may exceed server.max_request_bytes
    auth.install(app)
    app.dialects = dialect.Dialects(dialect.discover())
    for each in app.dialects.all:
        for blueprint in each.blueprints:
            app.register_blueprint(blueprint)
    app.extensions["mlxd_metrics"] = metrics = Metrics(daemon)
    observe.install(app, metrics)
    dashboard.install(app, metrics)
    ratelimit.install(app)  # after auth and observe: it needs the caller and the record

    @app.errorhandler(MlxdError)
    async def mlxd_error(error: MlxdError) -> Any:
        return _render(error)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Any:
        if error.code == 404:
            return _render(NotFound(f"no route for {request.method} {request.path}"))
        if error.code == 413:
            limit = server.max_request_bytes
            return _render(
                RequestTooLarge(f"request body exceeds {limit} bytes (server.max_request_bytes)")
            )
        wrapped = InvalidRequest(error.description or error.name)
        wrapped.status = error.code or 400
        return _render(wrapped)

    @app.errorhandler(Exception)
    async def unexpected(error: Exception) -> Any:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _render(MlxdError(f"internal error: {type(error).__name__}: {error}"))

    @app.before_serving
    async def start_engines() -> None:
        daemon.footprint = footprint = DaemonFootprint.measure()
        log.info(
            "daemon up in %.2f s, %d MiB resident before any model",
            footprint.startup_s,
            footprint.rss_bytes >> 20,
        )
        app.background = [asyncio.create_task(daemon.start())]
        if daemon.config_path is not None:
            app.background.append(
                asyncio.create_task(watch_config(daemon.config_path, daemon.reload))
            )
            reload_on_sighup(daemon.reload)

    @app.after_serving
    async def stop_engines() -> None:
        for task in app.background:
            task.cancel()
        await daemon.close()

    return app


def _render(error: MlxdError) -> ResponseReturnValue:
    # Each SDK parses only its own error shape: the dialect that served the request renders it.
    observe.failed(error.message)
    return dialect.render_error(error)


async def serve(app: App, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM, then drain (see `shutdown`)."""
    config = HypercornConfig()
    # server.ollama_port: the same app also where Ollama clients look (11434 by convention).
    ollama_port = app.daemon.config.server.ollama_port
    ports = [port] + ([ollama_port] if ollama_port and ollama_port != port else [])
    config.bind = [f"[{host}]:{p}" if ":" in host else f"{host}:{p}" for p in ports]
    config.backlog = LISTEN_BACKLOG
    config.accesslog = None  # mlxd logs one line per request itself (api/middleware/observe.py)
    config.errorlog = logging.getLogger("hypercorn.error")  # through mlxd's log format
    # Requests have drained by the time the server stops; this only lets idle keep-alive
    # connections and the last bytes of finished responses go.
    config.graceful_timeout = 3
    stopping = shutdown.Shutdown(app.daemon, app.inflight)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.on_signal, sig)
    await hypercorn_serve(app, config, shutdown_trigger=stopping.stop.wait)
