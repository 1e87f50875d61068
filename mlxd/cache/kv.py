"""Cut a sequence's per-layer KV into blocks, and put blocks back together as a prompt cache.

mlx-lm's BatchGenerator merges per-sequence caches into a batch through `merge()`, which its
`QuantizedKVCache` lacks: quantized KV cannot join a batch. So with `kv_bits` blocks are
stored quantized (what the budgets count) and dequantized when they are assembled into the
plain `KVCache`s the generator accepts; the running batch itself computes in full precision.

On the CPU the blocks are assembled by mlxd's kernel straight into one buffer per layer with
room for the rest of the prompt, and a sequence admitted alone takes those buffers into its
batch as they are (`PrefixKVCache.merge`): the prefix is copied once, not four times.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxd import kernels
from mlxd.accel import backend_name

PARTS = ("keys", "values")
QUANTIZED = ("q", "scales", "biases")


def supports_prefix_cache(layers: list[Any]) -> bool:
    """Only plain per-layer KV caches can be cut into position-indexed blocks (not the
    rotating, chunked or recurrent caches some architectures make)."""
    return bool(layers) and all(type(c) is KVCache for c in layers)


class KVCodec:
    def __init__(self, bits: int | None, group_size: int):
        self.bits = bits
        self.group_size = group_size

    def encode(self, layers: list[KVCache], start: int, end: int) -> dict[str, mx.array]:
        """Positions [start, end) of a single-sequence cache, stacked over layers. Stacking
        copies, so a block owns exactly its own bytes (a slice would pin the whole cache)."""
        arrays: dict[str, mx.array] = {}
        for part in PARTS:
            stacked = mx.stack([getattr(c, part)[0, :, start:end, :] for c in layers])
            if self.bits is None:
                arrays[part] = stacked
                continue
            quantized = mx.quantize(stacked, group_size=self.group_size, bits=self.bits)
            for name, value in zip(QUANTIZED, quantized, strict=True):
                arrays[f"{part}.{name}"] = value
        return arrays

    def decode(self, blocks: list[Any], tokens: int, room: int = 0) -> list[KVCache]:
        """One KVCache per layer holding the blocks' first `tokens` positions in order (the
        last block may be used in part), evaluated; `room`: positions still to come (the
        rest of the prompt), which then fit without a copy."""
        parts = {part: [self._part(b.arrays, part) for b in blocks] for part in PARTS}
        held = sum(block.shape[2] for block in parts["keys"][:-1])
        for part in PARTS:
            parts[part][-1] = parts[part][-1][:, :, : tokens - held]
        if backend_name() == "cpu" and kernels.available():
            capacity = -(-(tokens + room) // BatchKVCache.step) * BatchKVCache.step
            layers = {part: kernels.assemble_kv(parts[part], capacity) for part in PARTS}
        else:
            layers = {part: list(mx.concatenate(parts[part], axis=2)[:, None]) for part in PARTS}
        # Evaluated now: the buffers then have no lazy siblings, so the cache's first update
        # writes into them in place.
        mx.eval(layers)
        caches: list[KVCache] = []
        for keys, values in zip(layers["keys"], layers["values"], strict=True):
            cache = PrefixKVCache()
            cache.keys, cache.values, cache.offset = keys, values, tokens
            caches.append(cache)
        return caches

    def _part(self, arrays: dict[str, mx.array], part: str) -> mx.array:
        if part in arrays:
            return arrays[part]
        q, scales, biases = (arrays[f"{part}.{name}"] for name in QUANTIZED)
        return mx.dequantize(q, scales, biases, group_size=self.group_size, bits=self.bits)


class PrefixKVCache(KVCache):
    """A layer's KV cache assembled from prefix blocks."""

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchKVCache:
        """mlx-lm's merge copies every cache into a new batch buffer of exactly their length
        (which the next token then outgrows, another copy); one sequence alone keeps its own
        buffer, room included."""
        if len(caches) != 1 or not isinstance(caches[0], PrefixKVCache):
            return BatchKVCache.merge(caches)
        [cache] = caches
        batch = BatchKVCache([0])
        # (keys, values, offset, left padding, positions in use): the cache's public state.
        batch.state = (
            cache.keys,
            cache.values,
            batch.offset + cache.offset,
            batch.left_padding,
            cache.offset,
        )
        return batch
