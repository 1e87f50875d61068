"""A text LLM: mlx-lm weights behind a continuous-batching scheduler.

What a request needs before it queues (prompt ids, processors, `Admission`) is worked out by
`RequestPreparation` (worker/llm_prepare.py), which the engine inherits; the draft model and
the KV cache's identity come from worker/llm_load.py."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Self

from mlxd.accel import backend_name
from mlxd.cache import PrefixCache, open_prefix_cache
from mlxd.cache.lease import PrefixLease
from mlxd.config import CacheConfig, ModelConfig, ServerConfig
from mlxd.constrain import Constrainer
from mlxd.errors import InvalidRequest, ModelLoadError, Unavailable
from mlxd.models.adapters import adapter_bytes
from mlxd.models.cpu_path_timing import choose_cpu_path
from mlxd.models.loader import FLOAT_DTYPES, LoadedModel, load_llm
from mlxd.models.lora import MultiLoRA
from mlxd.models.packability import float32_summary
from mlxd.runtime.engine import EventStream
from mlxd.types import EmbeddingInput, Embeddings, Event, GenerationRequest
from mlxd.worker import warm_up
from mlxd.worker.hooks import load_hooks
from mlxd.worker.llm_core import LLMCore
from mlxd.worker.llm_load import kv_identity, load_draft
from mlxd.worker.llm_prepare import RequestPreparation
from mlxd.worker.loop import Core, ModelLoop
from mlxd.worker.prompt import loaded_tool_format
from mlxd.worker.sequence import Output, Sequence

log = logging.getLogger("mlxd.engine")

DEFAULT_CONTEXT = 4096


@dataclass(frozen=True)
class Reply:
    """Where a sequence's events go: a queue on the event loop that submitted it."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event]


class LLMEngine(RequestPreparation):
    kind = "llm"

    def __init__(
        self,
        name: str,
        config: ModelConfig,
        loaded: LoadedModel,
        prefix_cache: PrefixCache | None = None,
        drive: Callable[[LLMEngine], Core[Sequence, Output]] | None = None,
        draft: LoadedModel | None = None,
    ):
        """`drive` wraps the core the model thread drives (a distributed rank's step sync,
        see worker/rank_cores.py); by default the thread drives the core itself. `draft`: the
        speculative draft model (mode draft)."""
        self.name = name
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.context_length = config.context_length or int(
            loaded.config.get("max_position_embeddings") or DEFAULT_CONTEXT
        )
        self.prefix_cache = prefix_cache
        # A GPU compiles kernels for each new shape: those of the common requests compile
        # here, while the model loads (worker/warm_up.py). A distributed group's ranks step
        # in lockstep from their first request on: they compile as they go.
        wanted = config.warm_up if config.warm_up is not None else backend_name() != "cpu"
        warm = wanted and drive is None
        self.core = LLMCore(
            name,
            loaded.model,
            loaded.tokenizer,
            config.batch,
            config.speculative,
            draft.model if draft else None,
            functools.partial(
                warm_up.rounds, loaded.tokenizer, config.batch, self.context_length, name
            )
            if warm
            else None,
        )
        self.memory_bytes = loaded.nbytes + config.cache.ram + (draft.nbytes if draft else 0)
        self.last_used = time.monotonic()
        self._open = 0  # requests from submit() until their stream ends
        self.chat_template: str | None = getattr(loaded.tokenizer, "chat_template", None)
        self.tool_format = loaded_tool_format(loaded.tokenizer)
        self._constrainer_instance: Constrainer | None = None
        self._constrainer_lock = threading.Lock()
        self._hooks = load_hooks()  # none unless MLXD_WORKER_HOOKS names a module (tests)
        self._adapter_slots: dict[str, int] = {}  # attached adapters by key (shared_pool.py)
        self._lora_lock = threading.Lock()
        # Last: the model thread starts here, and `drive` may use everything above.
        driven = self.core if drive is None else drive(self)
        self.loop = ModelLoop(name, driven, _deliver, config.batch.max_queue)

    @classmethod
    async def load(
        cls, name: str, config: ModelConfig, path: Path, server: Callable[[], ServerConfig]
    ) -> LLMEngine:
        """Load weights from a resolved model directory (see models.sources.resolve_source);
        the SSD KV tier lives under the server's cache_dir."""
        # Decided when the worker located the model: the timings are cached by now.
        cpu_path = await asyncio.to_thread(choose_cpu_path, path, config, server())
        loaded = await asyncio.to_thread(
            load_llm,
            path,
            dtype=config.dtype,
            model_name=name,
            adapter=config.adapter,
            cpu_path=cpu_path,
            cache_dir=server().cache_dir,
            kv_dtype=config.cache.kv_dtype,
        )
        identity = kv_identity(config, loaded)
        cache_dir = server().cache_dir
        draft = None
        if config.speculative and config.speculative.mode == "draft":
            draft = await asyncio.to_thread(
                load_draft, name, config.speculative, loaded, cache_dir, config.cache.kv_dtype
            )
        prefix_cache = await asyncio.to_thread(
            open_prefix_cache, loaded.model, identity, config.cache, cache_dir, loaded.kv_dtype
        )
        return await cls(name, config, loaded, prefix_cache, draft=draft).started()

    async def started(self) -> Self:
        """Once the model thread started: its warm-up, where it has one, is done. A load
        cancelled meanwhile (or a thread that died starting) closes the engine."""
        try:
            await asyncio.to_thread(self.loop.started.wait)
            if self.loop.failure is not None:
                raise ModelLoadError(f"model '{self.name}': {self.loop.failure}")
        except BaseException:
            await asyncio.shield(self.close())
            raise
        warmed = self._warm_up_stats()
        if warmed is not None:
            log.info(
                "model '%s': warmed up in %.1f s (steps of %s rows, greedy and top-p)",
                self.name,
                warmed["seconds"],
                ", ".join(map(str, warmed["rows"])),
            )
        return self

    @property
    def idle(self) -> bool:
        """No request between submit() and the end of its stream: the engine can be closed
        without cutting anyone (counted from submit's first line, so a request that looked
        this engine up just before a route flip is seen by the drain)."""
        return self._open == 0

    async def submit(self, request: GenerationRequest) -> EventStream:
        self._open += 1
        self.last_used = time.monotonic()
        try:
            prepared = await asyncio.to_thread(self.prepare, request)
            request = replace(request, max_tokens=self._admissible_max_tokens(request, prepared))
            reply = Reply(asyncio.get_running_loop(), asyncio.Queue())
            sequence = Sequence(request, prepared.prompt_ids, reply)
            sequence.processors = prepared.processors
            sequence.prefill = prepared.prefill
            sequence.slot = self._slot(request)
            # The prefix cache holds the base model's KV: an adapter's differs.
            if self.prefix_cache is not None and prepared.prefill is None and not sequence.slot:
                cache = self.prefix_cache
                root = cache.root(request.cache_scope)
                keys = await asyncio.to_thread(_prefetch, cache, prepared.prompt_ids, root)
                sequence.lease = PrefixLease(cache, prepared.prompt_ids, keys, root)
            self.loop.submit(sequence)
        except BaseException:
            self._ended()
            raise
        return EventStream(
            reply.events, prepared.admission, lambda: self.loop.abort(sequence), self._ended
        )

    def _slot(self, request: GenerationRequest) -> int:
        if request.adapter is None:
            return 0
        slot = self._adapter_slots.get(request.adapter)
        if slot is None:  # detached while the request was on its way
            raise Unavailable(f"model '{self.name}': adapter {request.adapter!r} is not attached")
        return slot

    async def attach_adapter(self, key: str, adapter: Path, model_name: str) -> None:
        """Load a LoRA adapter beside the base weights; requests whose `adapter` is `key`
        then run with it, in the same batches as everyone else (models/lora.py)."""

        def attach() -> int:
            with self._lora_lock:  # two views attaching at once make one MultiLoRA
                if self.core.lora is None:
                    dtype = FLOAT_DTYPES.get(self.loaded.dtype)  # None: kept as stored
                    self.core.lora = MultiLoRA(self.loaded.model, dtype)
            return self.core.lora.attach(adapter)

        try:
            slot = await asyncio.to_thread(attach)
        except ValueError as exc:
            raise ModelLoadError(
                f"model '{model_name}': adapter {adapter} does not fit the model: {exc}"
            ) from exc
        self._adapter_slots[key] = slot
        size = adapter_bytes(adapter)
        self.loaded = replace(self.loaded, nbytes=self.loaded.nbytes + size)
        self.memory_bytes += size

    async def detach_adapter(self, key: str) -> None:
        """Stop routing to the adapter (its slot stays: slots never move under a batch)."""
        self._adapter_slots.pop(key, None)

    def _ended(self) -> None:
        self._open -= 1
        self.last_used = time.monotonic()

    def resize_cache(self, cache: CacheConfig) -> None:
        """New cache budgets without reloading the weights (see config.plan.Resize)."""
        self.config = self.config.model_copy(update={"cache": cache})
        self.memory_bytes = self.loaded.nbytes + cache.ram
        if self.prefix_cache is not None:
            self.prefix_cache.resize(cache)

    @property
    def failure(self) -> str | None:
        """Why the model thread died, if it did (the reconciler then restarts the engine)."""
        return self.loop.failure

    async def count_prompt_tokens(self, request: GenerationRequest) -> int:
        return len(await asyncio.to_thread(self.encode, request))

    async def refresh_stats(self) -> None:
        """In process, `stats()` is always current."""

    async def embed(
        self, inputs: EmbeddingInput, *, truncate: bool, dimensions: int | None = None
    ) -> Embeddings:
        raise InvalidRequest(
            f"model '{self.name}' is of kind '{self.kind}'; /v1/embeddings needs a model of "
            "kind 'embedding'",
            param="model",
        )

    def stats(self) -> dict[str, Any]:
        s = self.core.stats
        return {
            "kind": self.kind,
            "dtype": self.loaded.dtype,
            "kv_dtype": self.loaded.kv_dtype,
            "cpu_path": self.loaded.cpu_path.as_dict() if self.loaded.cpu_path else None,
            "float32_layers": float32_summary(self.loaded.float32_layers) or None,
            "experts": self.loaded.experts or None,
            "weights_bytes": self.loaded.nbytes,
            "memory_bytes": self.memory_bytes,
            "context_length": self.context_length,
            "max_batch_size": self.config.batch.max_batch_size,
            "warm_up": self._warm_up_stats(),
            "running": self.core.running,
            "waiting": self.loop.waiting,
            "decode_steps": s.steps,
            "multi_sequence_steps": s.multi_sequence_steps,
            "max_batch_seen": s.max_batch_seen,
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "finished": s.finished,
            "cancelled": s.cancelled,
            "failed": s.failed,
            "cache": self.prefix_cache.stats() if self.prefix_cache else _NO_CACHE,
            "speculative": self._speculative_stats(),
        }

    def _warm_up_stats(self) -> dict[str, Any] | None:
        rounds = self.core.warm_up_rounds
        if not rounds:
            return None
        return {
            "seconds": round(sum(seconds for _, seconds in rounds), 3),
            "rows": sorted({rows for rows, _ in rounds}),
            "rounds": [{"rows": rows, "seconds": round(seconds, 3)} for rows, seconds in rounds],
        }

    def _speculative_stats(self) -> dict[str, Any] | None:
        speculator = self.core.speculator
        if speculator is None:
            return None
        return {"mode": speculator.config.mode, **speculator.counters.as_dict()}

    async def close(self) -> None:
        self.core.stop_warm_up()  # a close during the load's warm-up waits one round at most
        await asyncio.to_thread(self.loop.close)
        if self.prefix_cache is not None:
            await asyncio.to_thread(self.prefix_cache.close)  # finishes queued SSD writes


def _prefetch(cache: PrefixCache, prompt_ids: list[int], root: str) -> list[str]:
    """The prompt's block keys in its partition; its blocks found only on SSD are read into
    RAM here, on a worker thread, so the model thread never waits for the disk."""
    keys = cache.keys(prompt_ids, root)
    cache.prefetch(prompt_ids, keys, root)
    return keys


def _deliver(outputs: list[Output]) -> None:
    """On the model thread: one call per event loop for a whole step's events."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Output]] = {}
    for sequence, event in outputs:
        by_loop.setdefault(sequence.reply.loop, []).append((sequence, event))
    for loop, items in by_loop.items():
        # A closed loop (shutdown) raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[Output]) -> None:
    for sequence, event in items:
        sequence.reply.events.put_nowait(event)


_NO_CACHE: dict[str, Any] = {
    "hits": {"ram": 0, "ssd": 0},
    "misses": 0,
    "cached_tokens": 0,
    "bytes": {"ram": 0, "ssd": 0},
    "evictions": {"ram": 0, "ssd": 0},
}
