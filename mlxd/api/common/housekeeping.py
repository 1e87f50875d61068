"""Chores the app repeats while it serves (expiring stored batches and responses): each runs at
start and then every so often in the app's context, a failing run logged and the next still
due. Each is stopped before the app stops serving."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("mlxd.housekeeping")

Chore = Callable[[], Awaitable[None]]


def every(app: Any, interval_s: float, chore: Chore) -> asyncio.Task:
    """Run `chore` now and every `interval_s` seconds until the task is `stop`ped."""

    async def repeat() -> None:
        while True:
            try:
                async with app.app_context():
                    await chore()
            except Exception:
                log.exception("%s failed; it runs again in %.0fs", chore.__qualname__, interval_s)
            await asyncio.sleep(interval_s)

    return asyncio.create_task(repeat())


async def stop(task: asyncio.Task | None) -> None:
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
