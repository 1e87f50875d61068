"""The RAM tier: blocks up to a byte budget, LRU among the blocks no sequence is using."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from mlxd.cache.blocks import Block


class RamTier:
    """Thread-safe: the model thread reads and stores, request threads promote SSD blocks."""

    def __init__(self, budget: int, on_evict: Callable[[Block], None]):
        self.budget = budget
        self.nbytes = 0
        self.evictions = 0
        self._on_evict = on_evict
        self._blocks: OrderedDict[str, Block] = OrderedDict()  # least recently used first
        self._children: dict[str, set[str]] = {}  # parent key → its blocks' keys here
        self._lock = threading.Lock()

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: str) -> Block | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                self._blocks.move_to_end(key)
                block.last_used = time.monotonic()
            return block

    def children(self, parent: str) -> list[Block]:
        """The blocks here that follow `parent` (the prompts that went on from it)."""
        with self._lock:
            return [self._blocks[key] for key in self._children.get(parent, ())]

    def put(self, block: Block) -> None:
        """Keep `block` (most recently used); evicts others, or the block itself, to fit."""
        with self._lock:
            if block.key in self._blocks:
                return
            self._blocks[block.key] = block
            self._children.setdefault(block.parent, set()).add(block.key)
            self.nbytes += block.nbytes
            evicted = self._evict()
        self._spill(evicted)

    def acquire(self, blocks: Iterable[Block]) -> None:
        with self._lock:
            for block in blocks:
                block.refs += 1

    def release(self, blocks: Iterable[Block]) -> None:
        with self._lock:
            for block in blocks:
                block.refs -= 1
            evicted = self._evict()  # the budget may have been exceeded while they were pinned
        self._spill(evicted)

    def resize(self, budget: int) -> None:
        with self._lock:
            self.budget = budget
            evicted = self._evict()
        self._spill(evicted)

    def _evict(self) -> list[Block]:
        evicted: list[Block] = []
        if self.nbytes <= self.budget:
            return evicted
        for key in [k for k, b in self._blocks.items() if b.refs == 0]:
            block = self._blocks.pop(key)
            siblings = self._children[block.parent]
            siblings.discard(key)
            if not siblings:
                del self._children[block.parent]
            self.nbytes -= block.nbytes
            self.evictions += 1
            evicted.append(block)
            if self.nbytes <= self.budget:
                break
        return evicted

    def _spill(self, evicted: list[Block]) -> None:
        for block in evicted:  # outside the lock: spilling enqueues a disk write
            self._on_evict(block)
