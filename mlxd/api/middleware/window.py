"""Amounts spent over a sliding minute, kept per client by the rate limits and the
failed-authentication throttle; `forget_idle` drops the clients whose windows have emptied, so
a stream of new addresses or keys cannot grow them without bound."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import TypeVar

WINDOW_S = 60.0

Key = TypeVar("Key")
Held = TypeVar("Held")


@dataclass
class Window:
    """Amounts (1 per request, or tokens) spent in the last WINDOW_S seconds."""

    spent: deque[tuple[float, int]] = field(default_factory=deque)
    total: int = 0

    def prune(self, now: float) -> None:
        while self.spent and self.spent[0][0] <= now - WINDOW_S:
            self.total -= self.spent.popleft()[1]

    def add(self, now: float, amount: int) -> None:
        if amount > 0:
            self.spent.append((now, amount))
            self.total += amount

    def free_in(self, now: float, limit: int) -> float:
        """Seconds until the total drops below `limit` again."""
        total = self.total
        for at, amount in self.spent:
            total -= amount
            if total < limit:
                return max(at + WINDOW_S - now, 0.0)
        return 0.0

    def idle(self, now: float) -> bool:
        """Nothing spent in the window: as good as a new one."""
        self.prune(now)
        return not self.spent


class IdleSweep:
    """Forgets idle entries of a per-client table, at most once per WINDOW_S (so the cost is
    one pass a minute, whatever the request rate)."""

    def __init__(self) -> None:
        self._swept_at = float("-inf")

    def __call__(
        self, table: MutableMapping[Key, Held], now: float, idle: Callable[[Held], bool]
    ) -> None:
        if now - self._swept_at < WINDOW_S:
            return
        self._swept_at = now
        for key in [key for key, held in table.items() if idle(held)]:
            del table[key]
