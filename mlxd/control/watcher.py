"""Reload triggers: the config file changing on disk, and SIGHUP.

Editors save by writing a temporary file and renaming it over the original, which replaces
the inode a file watch would follow; watching the directory and filtering by name sees every
way of saving. Bursts of events (write + rename + chmod) are debounced into one reload.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

from watchfiles import awatch

from mlxd.errors import ConfigError

log = logging.getLogger("mlxd.watch")

DEBOUNCE_MS = 200


async def watch_config(path: Path, reload: Callable[[], Awaitable[object]]) -> None:
    """Call `reload` after each change to `path`; runs until cancelled."""
    path = path.resolve()

    def is_config(_change: object, changed: str) -> bool:
        return Path(changed).name == path.name

    async for _ in awatch(path.parent, watch_filter=is_config, debounce=DEBOUNCE_MS, step=50):
        log.info("%s changed: reloading", path)
        await _reload_logging_errors(reload)


def reload_on_sighup(reload: Callable[[], Awaitable[object]]) -> None:
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks

    def on_signal() -> None:
        log.info("SIGHUP: reloading")
        task = loop.create_task(_reload_logging_errors(reload))
        pending.add(task)
        task.add_done_callback(pending.discard)

    loop.add_signal_handler(signal.SIGHUP, on_signal)


async def _reload_logging_errors(reload: Callable[[], Awaitable[object]]) -> None:
    try:
        await reload()
    except ConfigError:
        pass  # already logged by the daemon, which keeps serving the previous config
    except Exception:
        log.exception("reload failed")
