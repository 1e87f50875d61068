"""The engine protocol: what the API side and the reconciler may ask of a loaded model."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from mlxd.config import CacheConfig
from mlxd.types import Event, GenerationRequest


class Engine(Protocol):
    name: str
    kind: str
    memory_bytes: int  # weights + KV budget: what the registry's memory budget counts
    last_used: float  # time.monotonic() of the last request start or end

    @property
    def idle(self) -> bool:
        """True when no request is queued, running or being submitted."""
        ...

    async def submit(self, request: GenerationRequest) -> AsyncIterator[Event]:
        """Validate and queue a request, raising `MlxdError` if it cannot be taken; then
        iterate its events. Closing the iterator early cancels the sequence."""
        ...

    async def count_prompt_tokens(self, request: GenerationRequest) -> int:
        """Prompt tokens `request` would use (chat template and tools included)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Figures for /v1/status and /metrics, as of the last `refresh_stats()`."""
        ...

    async def refresh_stats(self) -> None:
        """Bring `stats()` up to date (a worker process is asked; in process, a no-op)."""
        ...

    def resize_cache(self, cache: CacheConfig) -> None:
        """Take new cache budgets in place (a reload that changed only those)."""
        ...

    async def close(self) -> None: ...
