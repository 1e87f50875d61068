"""Failed authentications throttled per client address: after MAX_FAILURES missing or wrong
keys within a minute, every request from that address is refused with 429 and `Retry-After`
(in the caller's dialect) until the oldest failure is a minute old, so keys cannot be guessed
at the speed of the network. Behind a reverse proxy every client has the proxy's address."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from mlxd.api.middleware.window import IdleSweep, Window
from mlxd.errors import Overloaded

MAX_FAILURES = 10


class FailedAuthentications:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._failures: dict[str, Window] = {}
        self._sweep = IdleSweep()

    def check(self, address: str) -> None:
        """Raise Overloaded while `address` has failed too often."""
        window = self._failures.get(address)
        if window is None:
            return
        now = self.clock()
        window.prune(now)
        if window.total >= MAX_FAILURES:
            retry = max(math.ceil(window.free_in(now, MAX_FAILURES)), 1)
            raise Overloaded(
                f"too many failed authentications from this address; retry in {retry}s",
                headers={"Retry-After": str(retry)},
            )

    def failed(self, address: str) -> None:
        now = self.clock()
        self._sweep(self._failures, now, lambda window: window.idle(now))
        self._failures.setdefault(address, Window()).add(now, 1)

    @property
    def tracked(self) -> int:
        """How many addresses with recent failures are held."""
        return len(self._failures)
