"""Graceful shutdown. The first SIGTERM/SIGINT stops taking requests (503 in the caller's
dialect; /health says "draining") while the listener stays open, so clients get an answer
rather than a refused connection; in-flight requests, open streams included, finish up to
`server.drain_timeout`; then the server stops and the engines close. A second signal exits
at once."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope
from quart import request

from mlxd.api.common.context import App
from mlxd.daemon import Daemon
from mlxd.errors import Unavailable

log = logging.getLogger("mlxd")

POLL_S = 0.05


class InFlight:
    """ASGI middleware counting HTTP requests from arrival until their last byte is sent
    (a stream counts until it ends). Requests that arrive while draining are not counted:
    they are turned away at once."""

    def __init__(self, app: Any, daemon: Daemon):
        self.app = app
        self.daemon = daemon
        self.count = 0

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] != "http" or self.daemon.draining:
            await self.app(scope, receive, send)
            return
        self.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.count -= 1


def install(app: App) -> InFlight:
    daemon = app.daemon
    inflight = InFlight(app.asgi_app, daemon)
    app.asgi_app = inflight  # type: ignore[method-assign]  # Quart's documented middleware hook

    @app.before_request
    async def refuse_while_draining() -> None:
        if daemon.draining and request.path != "/health":
            raise Unavailable("mlxd is shutting down", headers={"Retry-After": "5"})

    return inflight


class Shutdown:
    """Signal handling for `serve`: `stop` is set once the drain is over."""

    def __init__(self, daemon: Daemon, inflight: InFlight):
        self.daemon = daemon
        self.inflight = inflight
        self.stop = asyncio.Event()
        self._drain_task: asyncio.Task | None = None

    def on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.daemon.draining:
            log.warning("second %s: exiting now without draining", name)
            logging.shutdown()
            os._exit(128 + signum)
        self.daemon.draining = True
        timeout = self.daemon.config.server.drain_timeout
        log.info(
            "%s: no new requests; draining %d in flight (up to %gs, server.drain_timeout)",
            name,
            self.inflight.count,
            timeout,
        )
        self._drain_task = asyncio.create_task(self._drain(timeout))

    async def _drain(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.inflight.count and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
        if self.inflight.count:
            log.warning("drain timeout: cutting %d requests still in flight", self.inflight.count)
        else:
            log.info("drained: every in-flight request finished")
        self.stop.set()
