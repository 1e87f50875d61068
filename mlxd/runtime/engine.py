"""The engine protocol: what the API side and the reconciler may ask of a loaded model."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from mlxd.config import CacheConfig, ModelConfig, ServerConfig
from mlxd.memory_need import MemoryNeed
from mlxd.types import (
    Admission,
    EmbeddingInput,
    Embeddings,
    Event,
    Finished,
    GenerationRequest,
)


class EventStream:
    """What `Engine.submit` returns: a request's events, and its `admission`.

    Reading it to its `Finished` event ends the request; so does `aclose()`, a cancelled wait,
    or dropping it unread — and a request that ends before its Finished event is cancelled,
    so its slot is freed whatever happened on the API side.
    """

    def __init__(
        self,
        events: asyncio.Queue[Event],
        admission: Admission,
        cancel: Callable[[], None],
        ended: Callable[[], None],
    ):
        self.admission = admission
        self._events = events
        self._cancel = cancel
        self._ended_callback = ended
        self._ended = False
        self._on_cut_off: Callable[[int], None] | None = None

    def also_on_end(self, callback: Callable[[], None]) -> None:
        """Run `callback` too when the request ends (a view counting its own requests)."""
        ended = self._ended_callback

        def both() -> None:
            ended()
            callback()

        self._ended_callback = both

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> Event:
        if self._ended:
            raise StopAsyncIteration
        try:
            event = await self._events.get()
        except BaseException:  # the reader was cancelled or timed out
            self._end(finished=False)
            raise
        if isinstance(event, Finished):
            self._end(finished=True)
        return event

    async def aclose(self) -> None:
        self._end(finished=False)

    def on_cut_off(self, callback: Callable[[int], None]) -> None:
        """`callback(bound)` runs if the engine gives up on this stream's reader (`cut_off`)."""
        self._on_cut_off = callback

    def cut_off(self, bound: int) -> None:
        """The reader fell `bound` events behind, typically a response writer stuck on a
        client that stopped reading: the queued events are dropped, the sequence is cancelled
        (its slot freed), and the `on_cut_off` callback ends the response."""
        while not self._events.empty():
            self._events.get_nowait()
        self._end(finished=False)
        if self._on_cut_off is not None:
            self._on_cut_off(bound)

    def __del__(self) -> None:
        self._end(finished=False)

    def _end(self, finished: bool) -> None:
        if self._ended:
            return
        self._ended = True
        if not finished:
            self._cancel()
        self._ended_callback()


class Engine(Protocol):
    """A loaded model of any kind, in this process or behind a worker. Generation requests go
    to `submit`, embedding requests to `embed`; each kind refuses the other with a 400."""

    name: str
    kind: str
    last_used: float  # time.monotonic() of the last request start or end

    @property
    def memory_bytes(self) -> int:
        """What the memory budget counts for this engine."""
        ...

    @property
    def failure(self) -> str | None:
        """Why the engine died, if it did (the reconciler then restarts the model)."""
        ...

    @property
    def chat_template(self) -> str | None: ...

    @property
    def tool_format(self) -> str | None:
        """The tool-call format mlx-lm's loader found for the model's tokenizer, named as in
        `mlx_lm.tool_parsers` (None: unknown; the chat template decides)."""
        ...

    @property
    def idle(self) -> bool:
        """True when no request is queued, running or being submitted."""
        ...

    async def submit(self, request: GenerationRequest) -> EventStream:
        """Prepare and queue a request, raising `MlxdError` if it cannot be taken; then
        iterate its events. Closing the stream early cancels the sequence."""
        ...

    async def count_prompt_tokens(self, request: GenerationRequest) -> int:
        """Prompt tokens `request` would use (chat template and tools included)."""
        ...

    async def embed(
        self, inputs: EmbeddingInput, *, truncate: bool, dimensions: int | None = None
    ) -> Embeddings:
        """Vectors of `inputs` (texts, or token ids without special tokens)."""
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


class EngineStarter(Protocol):
    """Starts a model's engine and waits until it serves. `server` gives the live server
    settings; `make_room(need)` runs once the engine knows what it will hold, before it loads
    (raising refuses). `WorkerEngine.start` is the one for worker processes."""

    def __call__(
        self,
        name: str,
        config: ModelConfig,
        server: Callable[[], ServerConfig],
        make_room: Callable[[MemoryNeed], Awaitable[None]],
    ) -> Awaitable[Engine]: ...
