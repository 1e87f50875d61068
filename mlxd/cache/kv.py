"""Cut a sequence's per-layer KV into blocks, and put blocks back together as a prompt cache.

mlx-lm's BatchGenerator merges per-sequence caches into a batch through `merge()`, which its
`QuantizedKVCache` lacks: quantized KV cannot join a batch. So with `kv_bits` blocks are
stored quantized (what the budgets count) and dequantized when they are assembled into the
plain `KVCache`s the generator accepts; the running batch itself computes in full precision.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

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

    def decode(self, blocks: list[Any]) -> list[KVCache]:
        """One KVCache per layer holding the blocks' positions in order."""
        whole = {
            part: mx.concatenate([self._part(b.arrays, part) for b in blocks], axis=2)
            for part in PARTS
        }
        caches = []
        for layer in range(whole["keys"].shape[0]):
            cache = KVCache()
            cache.keys = whole["keys"][layer][None]
            cache.values = whole["values"][layer][None]
            cache.offset = cache.keys.shape[2]
            caches.append(cache)
        return caches

    def _part(self, arrays: dict[str, mx.array], part: str) -> mx.array:
        if part in arrays:
            return arrays[part]
        q, scales, biases = (arrays[f"{part}.{name}"] for name in QUANTIZED)
        return mx.dequantize(q, scales, biases, group_size=self.group_size, bits=self.bits)
