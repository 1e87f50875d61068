"""What the speech engines (stt, tts) share: a job core on its model thread, audio counted
for the real-time factor, and their figures for /v1/status, `mlxd ps` and the dashboard."""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar

from mlxd.config import ModelConfig
from mlxd.worker.jobs import JobCore, JobLoop
from mlxd.worker.service import ServiceEngine


class _Loaded(Protocol):
    nbytes: int


Loaded = TypeVar("Loaded", bound=_Loaded)


class SpeechEngine(ServiceEngine, Generic[Loaded]):
    def __init__(
        self, name: str, config: ModelConfig, loaded: Loaded, core: JobCore, loop: JobLoop
    ):
        super().__init__(name, config)
        self.loaded = loaded
        self.core = core
        self.loop = loop
        self.weights_bytes = loaded.nbytes
        self.memory_bytes = loaded.nbytes
        self.audio_seconds = 0.0  # heard (stt) or spoken (tts)

    def model_stats(self) -> dict[str, Any]:
        """The kind's own figures."""
        return {}

    def stats(self) -> dict[str, Any]:
        s = self.core.stats
        busy = s.busy_seconds
        waiting = self.loop.waiting
        return {
            "kind": self.kind,
            "weights_bytes": self.weights_bytes,
            "memory_bytes": self.memory_bytes,
            **self.model_stats(),
            "in_flight": self._open,
            "queue_depth": waiting,
            "running": max(self._open - waiting, 0),
            "requests": s.requests,
            "completed": s.completed,
            "failed": s.failed,
            "cancelled": s.cancelled,
            "audio_seconds": round(self.audio_seconds, 3),
            "busy_seconds": round(busy, 3),
            # Audio seconds per second of model time: above 1 is faster than real time.
            "real_time_factor": round(self.audio_seconds / busy, 2) if busy else None,
        }
