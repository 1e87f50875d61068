"""Stop strings matched on decoded text, across token boundaries.

Text that could still be the start of a stop string is held back until the next token
decides it, so a client never sees part of a stop string.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add decoded text. Returns (text safe to emit now, the stop string that matched)."""
        if not self.stops:
            return text, None
        buffer = self._held + text
        hits = [(i, -len(s), s) for s in self.stops if (i := buffer.find(s)) >= 0]
        if hits:
            index, _, stop = min(hits)
            self._held = ""
            return buffer[:index], stop
        keep = self._longest_partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], None

    def flush(self) -> str:
        """The held-back text, once generation ended without completing a stop string."""
        held, self._held = self._held, ""
        return held

    def _longest_partial_suffix(self, buffer: str) -> int:
        longest = min(len(buffer), max(len(s) for s in self.stops) - 1)
        for size in range(longest, 0, -1):
            tail = buffer[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0
