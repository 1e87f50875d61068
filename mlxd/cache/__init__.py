"""Tiered KV (prefix) cache: hashed token blocks in RAM, spilled to an SSD tier on disk."""

from mlxd.cache.prefix import Match, PrefixCache, open_prefix_cache

__all__ = ["Match", "PrefixCache", "open_prefix_cache"]
