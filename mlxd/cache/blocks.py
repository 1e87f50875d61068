"""Block identity: a prompt cut into fixed-size token blocks, each keyed by a chained hash.

A block's key covers the model fingerprint, every token before it (through its parent's key)
and its own tokens, so equal keys mean equal prefixes. A hash collision is still checked for:
a block also carries its parent key and its tokens, and a lookup compares both.
"""

from __future__ import annotations

import hashlib
import json
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

ROOT = ""  # the parent key of a prompt's first block
FORMAT_VERSION = 1


def fingerprint(**identity: Any) -> str:
    """A short stable digest of everything that makes cached KV valid for a model."""
    text = json.dumps({"format": FORMAT_VERSION, **identity}, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def block_key(model: str, parent: str, tokens: list[int] | tuple[int, ...]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(model.encode())
    digest.update(parent.encode())
    digest.update(array("q", tokens).tobytes())
    return digest.hexdigest()


def block_keys(model: str, tokens: list[int], block_size: int, root: str = ROOT) -> list[str]:
    """Keys of the full blocks of `tokens`, each chained on the one before, the first on
    `root` (a partition's own root keeps its blocks apart from every other partition's)."""
    keys: list[str] = []
    parent = root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_key(model, parent, tokens[start : start + block_size])
        keys.append(parent)
    return keys


@dataclass(eq=False)
class Block:
    """The KV of `tokens` for every layer: arrays named keys/values (or their quantized parts:
    keys.q, keys.scales, keys.biases, …), each stacked over layers as [L, heads, tokens, dim]."""

    key: str
    parent: str
    tokens: tuple[int, ...]
    arrays: dict[str, mx.array]
    refs: int = 0  # sequences using it; only unreferenced blocks may be evicted
    last_used: float = field(default_factory=time.monotonic)
    # Where the block last came from, until a hit reports it (for hits-by-tier stats).
    source: str = "ram"

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def matches(self, parent: str, tokens: list[int] | tuple[int, ...]) -> bool:
        """False on a key collision: another prefix hashed to this key."""
        return self.parent == parent and self.tokens == tuple(tokens)
