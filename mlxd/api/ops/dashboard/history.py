"""What the dashboard remembers beyond `/v1/status`: 15 minutes of per-model samples (tok/s,
queue depth) and the last 200 access lines. In memory only: a restart starts them afresh."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

SAMPLE_INTERVAL_S = 5.0
HISTORY_S = 15 * 60
REQUEST_LOG_SIZE = 200
# Page loads, the dashboard's own polling and monitors' probes are not what a user looks for.
UNLOGGED_PREFIXES = ("/dashboard/", "/health", "/metrics")
UNLOGGED_ENDPOINTS = frozenset({"/"})


@dataclass(frozen=True)
class Sample:
    at: float  # unix time
    tokens_per_s: float
    queue_depth: int
    running: int


class History:
    """A ring buffer of samples per model; `span_s / interval_s` samples each."""

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S, span_s: float = HISTORY_S) -> None:
        self.interval_s = interval_s
        self.span_s = span_s
        self._size = max(int(span_s // interval_s), 1)
        self._samples: dict[str, deque[Sample]] = {}

    def add(self, model: str, sample: Sample) -> None:
        self._samples.setdefault(model, deque(maxlen=self._size)).append(sample)

    def series(self, now: float) -> dict[str, list[dict[str, Any]]]:
        """Samples younger than the span, per model; a model removed long ago drops out."""
        since = now - self.span_s
        out = {}
        for model, samples in list(self._samples.items()):
            recent = [asdict(s) for s in samples if s.at >= since]
            if recent:
                out[model] = recent
            else:
                del self._samples[model]
        return out


class RequestLog:
    """The last `size` access lines, as the observer's fields (see `observe.close`)."""

    def __init__(self, size: int = REQUEST_LOG_SIZE) -> None:
        self._lines: deque[dict[str, Any]] = deque(maxlen=size)

    def add(self, fields: dict[str, Any], at: float) -> None:
        endpoint = fields.get("endpoint") or ""
        if endpoint in UNLOGGED_ENDPOINTS or endpoint.startswith(UNLOGGED_PREFIXES):
            return
        self._lines.append({**fields, "at": at})

    def lines(self, model: str | None = None) -> list[dict[str, Any]]:
        """Newest first; only `model`'s when given."""
        return [line for line in reversed(self._lines) if model is None or line["model"] == model]
