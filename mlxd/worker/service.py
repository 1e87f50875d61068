"""What the engines that do not generate text share (embedding, stt, tts): in-flight
accounting for drains and idle_ttl, the model thread's failure, and a 400 for the requests
of the other kinds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mlxd.config import SERVES, CacheConfig, ModelConfig
from mlxd.errors import InvalidRequest
from mlxd.runtime.engine import EventStream
from mlxd.types import EmbeddingInput, Embeddings, GenerationRequest
from mlxd.worker.loop import ModelLoop


class ServiceEngine:
    """Base of an engine answering whole requests through a `ModelLoop` it sets as `loop`."""

    kind: str  # set by each subclass
    chat_template: str | None = None  # none of these has one
    tool_format: str | None = None
    loop: ModelLoop[Any, Any]

    def __init__(self, name: str, config: ModelConfig):
        self.name = name
        self.config = config
        self.last_used = time.monotonic()
        self._open = 0  # requests from their first line until they return

    @property
    def idle(self) -> bool:
        return self._open == 0

    @property
    def failure(self) -> str | None:
        """Why the model thread died, if it did (the reconciler then restarts the engine)."""
        return self.loop.failure

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Around a request, from its first line: a drain must see a request that already
        holds the engine, and idle_ttl counts from its end."""
        self._open += 1
        self.last_used = time.monotonic()
        try:
            yield
        finally:
            self._open -= 1
            self.last_used = time.monotonic()

    def refuse(self, what: str) -> InvalidRequest:
        return InvalidRequest(
            f"model '{self.name}' is of kind '{self.kind}': it serves {SERVES[self.kind]}, "
            f"not {what}",
            param="model",
        )

    async def submit(self, request: GenerationRequest) -> EventStream:
        raise self.refuse("text generation")

    async def count_prompt_tokens(self, request: GenerationRequest) -> int:
        raise self.refuse("text generation")

    async def embed(
        self, inputs: EmbeddingInput, *, truncate: bool, dimensions: int | None = None
    ) -> Embeddings:
        raise self.refuse("embeddings")

    async def refresh_stats(self) -> None:
        """In process, `stats()` is always current."""

    def resize_cache(self, cache: CacheConfig) -> None:
        """These keep no KV: a cache-only reload just records the new settings."""
        self.config = self.config.model_copy(update={"cache": cache})

    async def close(self) -> None:
        await asyncio.to_thread(self.loop.close)
