"""Models that share one engine: the same base weights under several LoRA adapters.

Models naming the same source and engine settings apart from `adapter:` are served by one
engine (one worker process, one copy of the base weights); each model is a `SharedView` of it
that tags its requests with its adapter, so the base's rows and every adapter's rows decode in
the same batches (models/lora.py). The first view starts the engine and later ones wait for
that same start (single flight); each view attaches its adapter and detaches it on close; the
engine closes with its last view. When the engine dies every view reports it, and each
restarts into a fresh shared engine as any model would.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from mlxd.config import CacheConfig, ModelConfig
from mlxd.errors import MlxdError
from mlxd.runtime.engine import Engine, EventStream
from mlxd.types import EmbeddingInput, Embeddings, GenerationRequest

log = logging.getLogger("mlxd.engine")


class AdapterHost(Engine, Protocol):
    """An engine that takes LoRA adapters (LLMEngine, or a WorkerEngine hosting one)."""

    async def attach_adapter(self, key: str, adapter: Path, model_name: str) -> None: ...

    async def detach_adapter(self, key: str) -> None: ...


class _Base:
    """One shared engine: starting, serving, or dead."""

    def __init__(self, key: str, start: Coroutine[Any, Any, AdapterHost]):
        self.key = key
        self.members = 0  # views, and loads waiting to become views
        self.views: list[SharedView] = []
        # Its own task: no one view's cancelled load cancels the start the others wait for.
        self.starting: asyncio.Task[AdapterHost] = asyncio.create_task(start)

    @property
    def failed(self) -> bool:
        task = self.starting
        if not task.done():
            return False
        return task.cancelled() or task.exception() is not None or task.result().failure is not None


class EnginePool:
    """The shared engines, by group key (see control/share_groups.py `share_key`)."""

    def __init__(self) -> None:
        self._bases: dict[str, _Base] = {}
        self._ids = itertools.count(1)

    def serves(self, key: str) -> bool:
        """Whether an engine runs (or starts) under `key`: a model of that group joins it."""
        base = self._bases.get(key)
        return base is not None and not base.failed

    async def view(
        self,
        name: str,
        config: ModelConfig,
        key: str,
        start: Callable[[], Coroutine[Any, Any, AdapterHost]],
    ) -> SharedView:
        """A view for model `name` of the engine shared under `key`, started by `start()`
        unless it already runs (or is starting); the view's adapter is attached to it."""
        base = self._bases.get(key)
        if base is None or base.failed:
            base = self._bases[key] = _Base(key, start())
        base.members += 1
        try:
            engine = await asyncio.shield(base.starting)
            adapter = None
            if config.adapter is not None:
                adapter = f"{name}#{next(self._ids)}"
                await engine.attach_adapter(adapter, config.adapter, name)
        except BaseException:
            await self._leave(base)
            raise
        view = SharedView(name, engine, adapter, base, self)
        base.views.append(view)
        return view

    async def _leave(self, base: _Base) -> None:
        base.members -= 1
        if base.members > 0:
            return
        if self._bases.get(base.key) is base:
            del self._bases[base.key]
        if not base.starting.done():
            base.starting.cancel()
            with contextlib.suppress(BaseException):
                await base.starting
        elif not base.starting.cancelled() and base.starting.exception() is None:
            await base.starting.result().close()

    async def close_view(self, view: SharedView) -> None:
        base = view.base
        if view.adapter is not None and view.engine.failure is None:
            with contextlib.suppress(MlxdError):
                await view.engine.detach_adapter(view.adapter)
        base.views.remove(view)
        await self._leave(base)


class SharedView:
    """One model's face of a shared engine (the `Engine` the reconciler and the API see)."""

    def __init__(
        self, name: str, engine: AdapterHost, adapter: str | None, base: _Base, pool: EnginePool
    ):
        self.name = name
        self.kind = engine.kind
        self.engine = engine
        self.adapter = adapter  # the engine's key for this model's adapter; None: the base
        self.base = base
        self._pool = pool
        self.last_used = time.monotonic()
        self._open = 0

    @property
    def memory_bytes(self) -> int:
        """The shared engine counts once, on its first view (the budget sums every model)."""
        return self.engine.memory_bytes if self.base.views[:1] == [self] else 0

    @property
    def failure(self) -> str | None:
        return self.engine.failure

    @property
    def chat_template(self) -> str | None:
        return self.engine.chat_template

    @property
    def tool_format(self) -> str | None:
        return self.engine.tool_format

    @property
    def idle(self) -> bool:
        return self._open == 0

    async def submit(self, request: GenerationRequest) -> EventStream:
        self._open += 1
        self.last_used = time.monotonic()
        try:
            stream = await self.engine.submit(replace(request, adapter=self.adapter))
        except BaseException:
            self._ended()
            raise
        stream.also_on_end(self._ended)
        return stream

    def _ended(self) -> None:
        self._open -= 1
        self.last_used = time.monotonic()

    async def count_prompt_tokens(self, request: GenerationRequest) -> int:
        return await self.engine.count_prompt_tokens(request)

    async def embed(
        self, inputs: EmbeddingInput, *, truncate: bool, dimensions: int | None = None
    ) -> Embeddings:
        return await self.engine.embed(inputs, truncate=truncate, dimensions=dimensions)

    def stats(self) -> dict[str, Any]:
        # The engine's figures (pid, rss, weights: one base plus every adapter), but its
        # memory summed once over its models, as the budget counts it.
        others = sorted(v.name for v in self.base.views if v is not self)
        stats = self.engine.stats()
        return {**stats, "memory_bytes": self.memory_bytes, "shares_engine_with": others}

    async def refresh_stats(self) -> None:
        await self.engine.refresh_stats()

    def resize_cache(self, cache: CacheConfig) -> None:
        self.engine.resize_cache(cache)

    async def close(self) -> None:
        await self._pool.close_view(self)
