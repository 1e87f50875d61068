"""Rows of a batch: one sequence each, its KV cache one row of the batch's per-layer caches.

mlxd's prompt and decode batches stand on mlx-lm's public cache classes alone: a row's
caches are merged into batch caches (`merge`), batches joined (`extend`), rows dropped
(`filter`) and a row's KV read out (`extract`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, TokenBuffer

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass(eq=False)
class Row:
    """A sequence in a batch. `tokens`: those its KV cache holds, and in a decode batch its
    pending token (the context logits processors and drafts read)."""

    uid: int
    tokens: list[int]
    max_tokens: int
    sampler: Sampler
    processors: tuple[LogitsProcessor, ...] = ()
    # Decode state (see DecodeBatch): tokens handed out so far; the processors' context.
    generated: int = 0
    context: TokenBuffer | None = None
    # Admitted, its first token not computed yet; its first token went out with the step
    # that computed it, so the token the next step feeds is out already.
    fresh: bool = False
    early: bool = False


class RowBatch:
    """Rows and their per-layer batch caches, kept in the same order."""

    def __init__(self, model: Any, rows: list[Row], cache: list[Any]):
        self.model = model
        self.rows = rows
        self.cache = cache

    @property
    def uids(self) -> list[int]:
        return [row.uid for row in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def filter(self, keep: list[int]) -> None:
        """Keep the rows at these indices, in this order."""
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = []
        for cache in self.cache:
            cache.filter(keep)

    def extend(self, other: RowBatch) -> None:
        self.rows += other.rows
        if not self.cache:
            self.cache = other.cache
        elif other.cache:
            for mine, theirs in zip(self.cache, other.cache, strict=True):
                mine.extend(theirs)
        other.rows, other.cache = [], []

    def extract_cache(self, index: int) -> list[Any]:
        """A copy of the row's per-layer KV."""
        return [cache.extract(index) for cache in self.cache]

    def route(self) -> None:
        """Tell a multi-LoRA model (see worker.llm_core) which sequences the next forward
        pass's rows are, so each row uses its own adapter."""
        route = getattr(self.model, "route_rows", None)
        if route is not None:
            route(self.uids)


def merge_caches(caches: list[list[Any]]) -> list[Any]:
    """Per-layer batch caches from each row's own per-layer caches."""
    merged = []
    for layer in zip(*caches, strict=True):
        merge = getattr(layer[0], "merge", None)
        if merge is None:
            raise ValueError(f"{type(layer[0]).__name__} cannot be batched")
        merged.append(merge(list(layer)))
    return merged


def select_rows(cache: Any, indices: list[int]) -> Any:
    """A batch cache of these rows, the original left whole. A plain batch KV cache's
    `filter` gathers into new arrays, so a shallow copy suffices; other kinds are copied
    whole first (their `filter` may work in place)."""
    selected = copy.copy(cache) if type(cache) is BatchKVCache else copy.deepcopy(cache)
    selected.filter(indices)
    return selected


def finalize_used_span(cache: Any) -> None:
    """`cache.finalize()` at the end of a prefill of prompts of different lengths
    (right-padded, then rolled to left padding), rolling only the positions in use of a plain
    batch KV cache. mlx-lm rolls the whole buffer, allocated 256 positions at a time, with a
    single-threaded gather: 52 ms after a 156 ms prefill of ten short prompts on SmolLM2.
    Only here: speculation's rollback (speculative.roll_back) keeps the buffer's room, and
    trimmed, the next write would copy the whole cache."""
    if type(cache) is BatchKVCache:
        trim_allocation(cache, cache.size())
    cache.finalize()


def trim_allocation(cache: BatchKVCache, size: int) -> None:
    """Keep the first `size` allocated positions, at least all those written (a write past
    the end allocates more)."""
    if cache.keys is not None and cache.keys.shape[2] > size >= cache.size():
        cache.keys = cache.keys[..., :size, :]
        cache.values = cache.values[..., :size, :]


def row_view(cache: Any, index: int) -> Any:
    """`extract` of a plain batch KV cache without its copy (other kinds: `extract`)."""
    if type(cache) is not BatchKVCache:
        return cache.extract(index)
    assert cache.keys is not None and cache.values is not None  # a row in a batch has KV
    row = KVCache()
    padding = cast(int, cache.left_padding[index].item())
    end = cache.size()
    row.keys = cache.keys[index : index + 1, :, padding:end]
    row.values = cache.values[index : index + 1, :, padding:end]
    row.offset = end - padding
    return row
