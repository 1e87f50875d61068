"""The Quart app as mlxd uses it: the state `create_app` keeps on it, typed, and `current_app`
typed to match (routes import it from here rather than from quart)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, cast

import quart

if TYPE_CHECKING:
    from mlxd.api.common.dialect import Dialects
    from mlxd.api.middleware.drain import InFlight
    from mlxd.daemon import Daemon


class App(quart.Quart):
    """What `create_app` keeps on the app: the daemon, the API dialects it serves, the
    in-flight counter (shutdown.py) and the tasks running while it serves."""

    daemon: Daemon
    dialects: Dialects
    inflight: InFlight
    background: list[asyncio.Task[None]]


# The same proxy as quart's: quart types it as a plain Quart, while mlxd's app is always an App.
current_app = cast(App, quart.current_app)
