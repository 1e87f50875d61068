"""The prefix cache of one engine: which leading blocks of a prompt are cached, where, and the
KV to start its prefill from.

Partitions: a request names its `scope` (an opaque digest of the API key that sent it; "" on
an open daemon, where everyone shares one partition). A scope's blocks chain from a root of its
own, so lookups, partial-block matches and stores only ever meet blocks made under the same
scope: one key cannot time its prompts against another key's cached ones.

A prompt's last token is never cached: the generator needs at least one token to compute the
logits of the first generated one. Lookups (model thread) use the RAM tier only; SSD blocks are
promoted into RAM beforehand by `prefetch` on the request's own worker thread, so reading the
disk never stalls the batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxd.cache.blocks import ROOT, Block, block_key, block_keys, fingerprint
from mlxd.cache.kv import KVCodec, supports_prefix_cache
from mlxd.cache.ram import RamTier
from mlxd.cache.ssd import SsdTier
from mlxd.config import CacheConfig

log = logging.getLogger("mlxd.cache")


@dataclass
class Match:
    """The cached leading blocks of a prompt (empty on a miss); the last may be used in
    part: `tokens` counts the positions used."""

    blocks: list[Block] = field(default_factory=list)
    tokens: int = 0


@dataclass
class CacheCounters:
    hits_ram: int = 0
    hits_ssd: int = 0
    misses: int = 0
    cached_tokens: int = 0
    collisions: int = 0


class PrefixCache:
    def __init__(
        self,
        identity: dict[str, Any],
        config: CacheConfig,
        directory: Path | None,
        kv_dtype: str | None = None,
    ):
        """`identity` (source, weights, dtype, …) goes into the fingerprint with the block
        layout, so blocks of another model, dtype or layout are never used. `kv_dtype`: the
        dtype of the model's KV (None: not known before its first block), which SSD blocks
        must have too."""
        self.fingerprint = fingerprint(
            **identity,
            block_size=config.block_size,
            kv_bits=config.kv_bits,
            kv_group_size=config.kv_group_size,
        )
        self.block_size = config.block_size
        self.codec = KVCodec(config.kv_bits, config.kv_group_size)
        self.kv_dtype = kv_dtype
        self.counters = CacheCounters()
        self.ssd = (
            SsdTier(
                directory / self.fingerprint,
                self.fingerprint,
                config.ssd,
                config.ssd_ttl,
                getattr(mx, kv_dtype) if kv_dtype else None,
            )
            if directory is not None
            else None
        )
        self.ram = RamTier(config.ram, on_evict=self._spill)

    @property
    def enabled(self) -> bool:
        return self.ram.budget > 0

    def keys(self, prompt_ids: list[int], root: str = ROOT) -> list[str]:
        """Block keys of the cacheable part of a prompt (all but its last token), in the
        partition whose root is `root` (see `root`)."""
        return block_keys(self.fingerprint, prompt_ids[:-1], self.block_size, root)

    def root(self, scope: str) -> str:
        """The root of `scope`'s partition: the shared one's for "", else a key no block of
        another scope can chain from."""
        return block_key(self.fingerprint, ROOT, list(scope.encode())) if scope else ROOT

    # -- request threads -------------------------------------------------------------------

    def prefetch(self, prompt_ids: list[int], keys: list[str], root: str = ROOT) -> None:
        """Promote the prompt's leading blocks found only on disk into RAM."""
        if self.ssd is None or not self.enabled:
            return
        parent = root
        for index, key in enumerate(keys):
            if key not in self.ram:
                block = self.ssd.load(key, parent, self._tokens(prompt_ids, index))
                if block is None:
                    return
                self.ram.put(block)
            parent = key

    # -- model thread ----------------------------------------------------------------------

    def match(self, prompt_ids: list[int], keys: list[str], root: str = ROOT) -> Match:
        """The longest run of leading blocks in RAM that really hold this prompt's tokens,
        then the leading positions of a block that went on from there with some of the
        prompt's next tokens (a position's KV depends on the tokens up to it alone): prompts
        that share a system prompt and part of a block after it do not compute those
        positions again (llama.cpp's slots do not either)."""
        found = Match()
        parent = root
        for index, key in enumerate(keys):
            block = self.ram.get(key)
            if block is None:
                break
            if not block.matches(parent, self._tokens(prompt_ids, index)):
                self.counters.collisions += 1
                break
            found.blocks.append(block)
            parent = key
        found.tokens = len(found.blocks) * self.block_size
        # The last prompt token is always fed, never cached.
        following = prompt_ids[
            found.tokens : min(found.tokens + self.block_size, len(prompt_ids) - 1)
        ]
        # Fewer positions than a quarter block are not worth pinning a block and assembling a
        # cache for (a chat template's first tokens); comparing that head in C keeps the scan
        # over a parent's children cheap.
        head = tuple(following[: max(1, self.block_size // 4)])
        shared, tail = 0, None
        for block in self.ram.children(parent):
            if block.tokens[: len(head)] == head:
                count = _common_prefix(block.tokens, following)
                if count > shared:
                    shared, tail = count, block
        if tail is not None and self.ram.get(tail.key) is not None:  # still here: touched
            found.blocks.append(tail)
            found.tokens += shared
        return found

    def acquire(self, match: Match, room: int = 0) -> list[KVCache]:
        """Pin the matched blocks for a sequence, count the hit, and build its prompt cache
        (with `room` for the prompt's positions after the match)."""
        if not match.blocks:
            self.counters.misses += 1
            return []
        if any(block.source == "ssd" for block in match.blocks):
            self.counters.hits_ssd += 1
        else:
            self.counters.hits_ram += 1
        for block in match.blocks:
            block.source = "ram"
        self.counters.cached_tokens += match.tokens
        self.ram.acquire(match.blocks)
        return self.codec.decode(match.blocks, match.tokens, room)

    def release(self, blocks: list[Block]) -> None:
        self.ram.release(blocks)

    def missing(self, keys: list[str]) -> bool:
        return self.enabled and any(key not in self.ram for key in keys)

    def store(
        self, prompt_ids: list[int], keys: list[str], layers: list[Any], root: str = ROOT
    ) -> None:
        """Keep the blocks of a prefilled prompt that are not cached yet (RAM, and SSD behind
        it so that they survive restarts). `layers` is the sequence's own per-layer cache."""
        parent = root
        new: list[Block] = []
        for index, key in enumerate(keys):
            if key not in self.ram:
                start = index * self.block_size
                arrays = self.codec.encode(layers, start, start + self.block_size)
                new.append(Block(key, parent, self._tokens(prompt_ids, index), arrays))
            parent = key
        mx.eval([block.arrays for block in new])
        for block in new:
            self.ram.put(block)
            self._spill(block)

    # -- any thread ------------------------------------------------------------------------

    def resize(self, config: CacheConfig) -> None:
        """Apply new budgets in place (block_size and kv_bits change the fingerprint instead)."""
        self.ram.resize(config.ram)
        if self.ssd is not None:
            self.ssd.resize(config.ssd, config.ssd_ttl)

    def stats(self) -> dict[str, Any]:
        c, ssd = self.counters, self.ssd
        return {
            "hits": {"ram": c.hits_ram, "ssd": c.hits_ssd},
            "misses": c.misses,
            "cached_tokens": c.cached_tokens,
            "bytes": {"ram": self.ram.nbytes, "ssd": ssd.nbytes if ssd else 0},
            "evictions": {"ram": self.ram.evictions, "ssd": ssd.evictions if ssd else 0},
            "blocks": {"ram": len(self.ram), "ssd": len(ssd) if ssd else 0},
            "collisions": c.collisions,
            "block_size": self.block_size,
            "kv_bits": self.codec.bits,
            "kv_dtype": self.kv_dtype,
            "fingerprint": self.fingerprint,
        }

    def close(self) -> None:
        if self.ssd is not None:
            self.ssd.close()

    def _tokens(self, prompt_ids: list[int], index: int) -> tuple[int, ...]:
        return tuple(prompt_ids[index * self.block_size : (index + 1) * self.block_size])

    def _spill(self, block: Block) -> None:
        if self.ssd is not None:
            self.ssd.put(block)


def open_prefix_cache(
    model: Any,
    identity: dict[str, Any],
    config: CacheConfig,
    cache_dir: Path | None,
    kv_dtype: str | None = None,
) -> PrefixCache | None:
    """The prefix cache for a loaded model, or None if its cache layout cannot be cut into
    blocks; the SSD tier goes under `cache_dir`/kv. `kv_dtype`: see `PrefixCache`."""
    if not supports_prefix_cache(make_prompt_cache(model)):
        log.info("kv cache: this architecture's cache cannot be split into blocks; disabled")
        return None
    directory = cache_dir / "kv" if cache_dir is not None else None
    return PrefixCache(identity, config, directory, kv_dtype)


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count
