"""The prefix cache without a model: block identity, the RAM and SSD tiers, quantized blocks."""

from __future__ import annotations

import os
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxd import kernels
from mlxd.cache.blocks import ROOT, Block, block_key, block_keys, fingerprint
from mlxd.cache.kv import KVCodec
from mlxd.cache.prefix import PrefixCache
from mlxd.cache.ram import RamTier
from mlxd.cache.ssd import SsdTier
from mlxd.config import CacheConfig

LAYERS, HEADS, DIM, BS = 3, 2, 64, 4


def layers_for(length: int, seed: int = 0, dtype: mx.Dtype = mx.float32) -> list[KVCache]:
    """A single sequence's per-layer cache, as the generator hands it out."""
    mx.random.seed(seed)
    caches = []
    for _ in range(LAYERS):
        cache = KVCache()
        cache.keys = mx.random.normal((1, HEADS, length, DIM)).astype(dtype)
        cache.values = mx.random.normal((1, HEADS, length, DIM)).astype(dtype)
        cache.offset = length
        caches.append(cache)
    return caches


def block(key: str, nbytes: int = 100) -> Block:
    return Block(key, ROOT, (1,), {"keys": mx.zeros((nbytes // 4,), dtype=mx.float32)})


def prefix_cache(
    tmp_path: Path | None = None, kv_dtype: str | None = None, **config
) -> PrefixCache:
    cache = CacheConfig(block_size=BS, **config)
    return PrefixCache({"model": "m"}, cache, tmp_path, kv_dtype)


# -- block identity -----------------------------------------------------------------------


def test_keys_chain_over_every_earlier_token() -> None:
    tokens = list(range(10))
    keys = block_keys("fp", tokens, BS)
    assert len(keys) == 2  # the partial third block is not a block
    assert keys == block_keys("fp", [*tokens[:8], 99, 98], BS)  # same full blocks
    changed_first = block_keys("fp", [7, *tokens[1:]], BS)
    assert changed_first[0] != keys[0] and changed_first[1] != keys[1]
    assert block_keys("other model", tokens, BS) != keys
    assert keys[1] == block_key("fp", keys[0], tokens[4:8])


def test_fingerprint_covers_identity_and_layout() -> None:
    base = fingerprint(source="a", dtype="float32", block_size=16, kv_bits=None)
    assert base == fingerprint(source="a", dtype="float32", block_size=16, kv_bits=None)
    assert base != fingerprint(source="b", dtype="float32", block_size=16, kv_bits=None)
    assert base != fingerprint(source="a", dtype="float16", block_size=16, kv_bits=None)
    assert base != fingerprint(source="a", dtype="float32", block_size=32, kv_bits=None)
    assert base != fingerprint(source="a", dtype="float32", block_size=16, kv_bits=8)


def test_the_last_prompt_token_is_never_cached() -> None:
    cache = prefix_cache()
    assert len(cache.keys(list(range(8)))) == 1  # 7 cacheable tokens: one full block
    assert len(cache.keys(list(range(9)))) == 2


# -- store and match ----------------------------------------------------------------------


def test_store_then_match_rebuilds_the_same_kv() -> None:
    cache = prefix_cache()
    prompt = list(range(11))
    layers = layers_for(len(prompt))
    keys = cache.keys(prompt)
    cache.store(prompt, keys, layers)
    assert not cache.missing(keys)

    longer = [*prompt[:8], 50, 51, 52, 53, 54]
    match = cache.match(longer, cache.keys(longer))
    assert match.tokens == 8
    rebuilt = cache.acquire(match)
    for original, cached in zip(layers, rebuilt, strict=True):
        assert cached.offset == 8
        keys, values = (
            cached.keys_and_values()
        )  # the positions held (the buffers may have room after)
        assert mx.array_equal(keys, original.keys[:, :, :8, :])
        assert mx.array_equal(values, original.values[:, :, :8, :])
    assert all(b.refs == 1 for b in match.blocks)
    cache.release(match.blocks)
    assert all(b.refs == 0 for b in match.blocks)
    assert cache.stats()["hits"] == {"ram": 1, "ssd": 0}
    assert cache.stats()["cached_tokens"] == 8


def test_a_prompt_sharing_part_of_a_block_reuses_those_positions() -> None:
    """After the whole blocks, the leading positions of a cached block that went on with
    some of the prompt's next tokens are used too; never the prompt's last token."""
    cache = prefix_cache()
    prompt = list(range(13))  # three whole blocks cached: 0-3, 4-7, 8-11
    layers = layers_for(len(prompt))
    cache.store(prompt, cache.keys(prompt), layers)
    other = [*prompt[:10], 70, 71, 72]  # two tokens into the third block
    match = cache.match(other, cache.keys(other))
    assert (match.tokens, len(match.blocks)) == (10, 3)
    rebuilt = cache.acquire(match, room=3)
    for original, cached in zip(layers, rebuilt, strict=True):
        keys, values = cached.keys_and_values()
        assert mx.array_equal(keys, original.keys[:, :, :10, :])
        assert mx.array_equal(values, original.values[:, :, :10, :])
    assert all(b.refs == 1 for b in match.blocks)
    cache.release(match.blocks)
    for length, cached in ((11, 10), (10, 9), (9, 8), (2, 1)):
        head = prompt[:length]
        assert cache.match(head, cache.keys(head)).tokens == cached


def test_a_scope_matches_only_its_own_blocks_whole_or_partial() -> None:
    """Blocks stored under one key's scope are neither a hit nor a partial hit (a shared first
    block's head) for another scope, nor for the shared partition."""
    cache = prefix_cache()
    prompt = list(range(13))
    mine, theirs = cache.root("scope-a"), cache.root("scope-b")
    cache.store(prompt, cache.keys(prompt, mine), layers_for(len(prompt)), mine)
    partial = [*prompt[:2], 70, 71, 72]  # only the first block's head in common
    for root in (theirs, cache.root("")):
        assert cache.match(prompt, cache.keys(prompt, root), root).tokens == 0
        assert cache.match(partial, cache.keys(partial, root), root).tokens == 0
    assert cache.match(prompt, cache.keys(prompt, mine), mine).tokens == 12
    assert cache.match(partial, cache.keys(partial, mine), mine).tokens == 2


def test_a_few_shared_positions_are_not_worth_a_partial_hit() -> None:
    """Under a quarter block in common (a chat template's first tokens) is a miss."""
    cache = PrefixCache({"model": "m"}, CacheConfig(block_size=16), None)
    prompt = list(range(17))
    cache.store(prompt, cache.keys(prompt), layers_for(len(prompt)))
    for shared, cached in ((3, 0), (4, 4)):
        other = [*prompt[:shared], *range(90, 100)]
        assert cache.match(other, cache.keys(other)).tokens == cached


def test_a_prefix_hit_alone_joins_its_batch_in_its_own_buffer() -> None:
    """The rebuilt cache has room for the rest of the prompt; a sequence admitted alone takes
    that buffer into its batch and its next tokens are written in place, holding what mlx-lm's
    own merge and growth would hold."""
    if not kernels.available():
        pytest.skip("mlxd's CPU kernels are not built (python -m mlxd.kernels.build)")
    cache = prefix_cache()
    prompt = list(range(13))
    layers = layers_for(len(prompt))
    cache.store(prompt, cache.keys(prompt), layers)
    match = cache.match(prompt, cache.keys(prompt))
    [rebuilt, *_] = cache.acquire(match, room=5)
    assert rebuilt.offset == 12
    assert rebuilt.keys.shape[2] >= 12 + 5
    batch = type(rebuilt).merge([rebuilt])
    assert batch.keys is rebuilt.keys  # no copy
    new_keys, new_values = mx.random.normal((2, 1, HEADS, 3, DIM))
    keys, values = batch.update_and_fetch(new_keys, new_values)

    reference = BatchKVCache.merge([layers_for(len(prompt))[0]])
    reference.trim(1)  # the prompt's last token is not cached
    expected_keys, expected_values = reference.update_and_fetch(new_keys, new_values)
    assert mx.array_equal(keys, expected_keys) and mx.array_equal(values, expected_values)
    assert batch.size() == 15 and mx.array_equal(batch.offset, reference.offset)
    cache.release(match.blocks)


def test_prefix_hits_admitted_together_merge_as_mlx_lm_merges() -> None:
    cache = prefix_cache()
    short, long = list(range(9)), list(range(100, 117))
    for prompt in (short, long):
        cache.store(prompt, cache.keys(prompt), layers_for(len(prompt), seed=len(prompt)))
    rebuilt = [cache.acquire(cache.match(p, cache.keys(p)), room=len(p)) for p in (short, long)]
    merged = type(rebuilt[0][0]).merge([r[0] for r in rebuilt])
    plain = []
    for r in rebuilt:
        layer = KVCache()
        layer.keys, layer.values = r[0].keys_and_values()
        layer.offset = r[0].offset
        plain.append(layer)
    expected = BatchKVCache.merge(plain)
    assert mx.array_equal(merged.keys, expected.keys)
    assert mx.array_equal(merged.left_padding, expected.left_padding)


def test_other_prefix_misses() -> None:
    cache = prefix_cache()
    prompt = list(range(11))
    cache.store(prompt, cache.keys(prompt), layers_for(11))
    other = [100, *prompt[1:]]
    match = cache.match(other, cache.keys(other))
    assert match.blocks == []
    assert cache.acquire(match) == []
    assert cache.stats()["misses"] == 1


def test_a_key_collision_is_a_miss() -> None:
    cache = prefix_cache()
    prompt = list(range(9))
    keys = cache.keys(prompt)
    cache.store(prompt, keys, layers_for(9))
    # Another prompt whose first block hashes (by construction here) to the same key.
    impostor = [9, 9, 9, 9, *prompt[4:]]
    match = cache.match(impostor, keys)
    assert match.blocks == []
    assert cache.stats()["collisions"] == 1


def test_stats_have_the_exported_shape() -> None:
    stats = prefix_cache().stats()
    assert set(stats["hits"]) == set(stats["bytes"]) == set(stats["evictions"]) == {"ram", "ssd"}
    assert isinstance(stats["misses"], int) and isinstance(stats["cached_tokens"], int)


# -- quantized blocks ---------------------------------------------------------------------


def test_quantized_blocks_are_smaller_and_close() -> None:
    layers = layers_for(8)
    full = KVCodec(None, 64).encode(layers, 0, 8)
    codec = KVCodec(8, 64)
    quantized = codec.encode(layers, 0, 8)
    mx.eval(full, quantized)
    full_bytes = sum(a.nbytes for a in full.values())
    quantized_bytes = sum(a.nbytes for a in quantized.values())
    assert quantized_bytes < full_bytes / 3
    [rebuilt, *_] = codec.decode([Block("k", ROOT, tuple(range(8)), quantized)], 8)
    assert mx.allclose(rebuilt.keys_and_values()[0], layers[0].keys, atol=0.05).item()


def test_block_bytes_are_measured_from_its_own_arrays() -> None:
    cache = prefix_cache()
    prompt = list(range(9))
    cache.store(prompt, cache.keys(prompt), layers_for(9))
    per_block = 2 * LAYERS * HEADS * BS * DIM * 4  # keys + values, float32
    assert cache.stats()["bytes"]["ram"] == 2 * per_block


# -- RAM tier -----------------------------------------------------------------------------


def test_ram_evicts_least_recently_used_unreferenced_blocks() -> None:
    evicted: list[str] = []
    ram = RamTier(300, on_evict=lambda b: evicted.append(b.key))
    a, b, c = block("a"), block("b"), block("c")
    for item in (a, b, c):
        ram.put(item)
    assert ram.nbytes == 300
    ram.get("a")  # a is now more recent than b
    ram.acquire([b])
    ram.put(block("d"))
    assert evicted == ["c"]  # b is oldest but pinned; c is the oldest unpinned
    ram.release([b])
    assert ram.nbytes == 300
    ram.resize(100)
    assert evicted == ["c", "b", "a"] and ram.nbytes == 100 and "d" in ram
    assert ram.evictions == 3


def test_ram_may_exceed_its_budget_only_while_blocks_are_pinned() -> None:
    ram = RamTier(100, on_evict=lambda b: None)
    a = block("a")
    ram.put(a)
    ram.acquire([a])
    ram.put(block("b"))  # a is pinned, so b (unpinned) goes at once
    assert "b" not in ram and ram.nbytes == 100
    ram.resize(0)
    assert ram.nbytes == 100  # still pinned
    ram.release([a])
    assert ram.nbytes == 0


# -- SSD tier -----------------------------------------------------------------------------


def stored_ssd(tmp_path: Path, **config) -> tuple[PrefixCache, list[int]]:
    cache = prefix_cache(tmp_path, ssd=10**8, **config)
    prompt = list(range(13))
    cache.store(prompt, cache.keys(prompt), layers_for(13))
    cache.ssd.flush()
    return cache, prompt


def files(cache: PrefixCache) -> list[Path]:
    return sorted(cache.ssd.directory.iterdir())


def test_ssd_blocks_survive_a_restart(tmp_path: Path) -> None:
    first, prompt = stored_ssd(tmp_path)
    first.close()
    assert len(files(first)) == 3
    again = prefix_cache(tmp_path, ssd=10**8)  # a new process: index rebuilt from the directory
    keys = again.keys(prompt)
    assert again.match(prompt, keys).blocks == []  # RAM is empty after a restart
    again.prefetch(prompt, keys)
    match = again.match(prompt, keys)
    assert match.tokens == 12
    rebuilt = again.acquire(match)
    assert mx.array_equal(rebuilt[0].keys_and_values()[0], layers_for(13)[0].keys[:, :, :12, :])
    assert again.stats()["hits"] == {"ram": 0, "ssd": 1}
    again.close()


def test_another_model_s_blocks_are_not_used(tmp_path: Path) -> None:
    first, prompt = stored_ssd(tmp_path)
    first.close()
    other = prefix_cache(tmp_path, ssd=10**8, kv_bits=8)  # another fingerprint, another folder
    other.prefetch(prompt, other.keys(prompt))
    assert other.match(prompt, other.keys(prompt)).blocks == []
    other.close()


def reopen(cache: PrefixCache) -> SsdTier:
    ssd = cache.ssd
    return SsdTier(ssd.directory, ssd.fingerprint, ssd.budget, ssd.ttl)


def test_partial_temp_file_and_truncated_file_are_deleted(tmp_path: Path) -> None:
    cache, _ = stored_ssd(tmp_path)
    cache.close()
    victim = files(cache)[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])  # killed mid-write without the temp+rename
    temp = cache.ssd.directory / "abc.1234.tmp.safetensors"
    temp.write_bytes(data[:100])  # a writer killed before its rename
    ssd = reopen(cache)
    assert not victim.exists() and not temp.exists()
    assert len(ssd) == 2
    ssd.close()


def test_foreign_files_are_deleted(tmp_path: Path) -> None:
    cache, _ = stored_ssd(tmp_path)
    cache.close()
    directory = cache.ssd.directory
    (directory / "notes.txt").write_text("hello")
    (directory / "0123.safetensors").write_bytes(b"not a safetensors file")
    mx.save_safetensors(str(directory / "feed.safetensors"), {"x": mx.zeros((2,))})
    ssd = reopen(cache)
    assert len(ssd) == 3
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        p.name for p in files(cache) if p.name not in ("notes.txt", "0123.safetensors")
    )
    assert not (directory / "feed.safetensors").exists()
    ssd.close()


def test_corrupt_data_is_detected_on_load_and_deleted(tmp_path: Path) -> None:
    cache, prompt = stored_ssd(tmp_path)
    cache.close()
    first_key = cache.keys(prompt)[0]
    path = cache.ssd.directory / f"{first_key}.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # same size, valid header: only the checksum can tell
    path.write_bytes(bytes(data))
    again = prefix_cache(tmp_path, ssd=10**8)
    again.prefetch(prompt, again.keys(prompt))
    assert again.match(prompt, again.keys(prompt)).blocks == []
    assert not path.exists()
    again.close()


def test_ttl_prunes_unused_blocks(tmp_path: Path) -> None:
    cache, prompt = stored_ssd(tmp_path, ssd_ttl=3600.0)
    stale = cache.ssd.directory / f"{cache.keys(prompt)[2]}.safetensors"
    old = time.time() - 7200
    os.utime(stale, (old, old))
    cache.close()
    ssd = reopen(cache)
    assert len(ssd) == 2 and not stale.exists()
    assert ssd.evictions == 1
    ssd.close()


def test_ssd_budget_evicts_the_least_recently_used(tmp_path: Path) -> None:
    cache, _ = stored_ssd(tmp_path)
    sizes = [p.stat().st_size for p in files(cache)]
    cache.ssd.resize(sum(sizes) - 1, None)
    assert len(cache.ssd) == 2
    assert cache.stats()["evictions"]["ssd"] == 1
    assert cache.stats()["bytes"]["ssd"] == sum(p.stat().st_size for p in files(cache))
    cache.close()


def test_ram_evictions_spill_to_ssd(tmp_path: Path) -> None:
    cache = prefix_cache(tmp_path, ssd=10**8, ram=1)
    prompt = list(range(9))
    cache.store(prompt, cache.keys(prompt), layers_for(9))
    cache.ssd.flush()
    stats = cache.stats()
    assert stats["bytes"]["ram"] == 0 and stats["evictions"]["ram"] == 2
    assert stats["blocks"]["ssd"] == 2
    cache.close()


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_blocks_round_trip_through_ssd(tmp_path: Path, bits: int) -> None:
    cache, prompt = stored_ssd(tmp_path, kv_bits=bits)
    ram_match = cache.match(prompt, cache.keys(prompt))
    expected = cache.codec.decode(ram_match.blocks, ram_match.tokens)
    cache.close()
    again = prefix_cache(tmp_path, ssd=10**8, kv_bits=bits)
    again.prefetch(prompt, again.keys(prompt))
    rebuilt = again.acquire(again.match(prompt, again.keys(prompt)))
    assert mx.array_equal(rebuilt[1].keys_and_values()[1], expected[1].keys_and_values()[1])
    again.close()


# -- a float16 KV cache (the CPU kernel path's default) -------------------------------------


def test_float16_blocks_round_trip_through_ram_and_ssd_as_float16(tmp_path: Path) -> None:
    """Blocks cut from a float16 cache stay float16 (half the bytes), are assembled back
    bit for bit, and a sequence's next float16 writes keep its batch cache float16."""
    cache = prefix_cache(tmp_path, kv_dtype="float16", ssd=10**8)
    prompt = list(range(13))
    layers = layers_for(len(prompt), dtype=mx.float16)
    cache.store(prompt, cache.keys(prompt), layers)
    assert cache.stats()["kv_dtype"] == "float16"
    assert cache.stats()["bytes"]["ram"] == 3 * LAYERS * 2 * HEADS * BS * DIM * 2
    match = cache.match(prompt, cache.keys(prompt))
    rebuilt = cache.acquire(match, room=4)
    for original, cached in zip(layers, rebuilt, strict=True):
        keys, values = cached.keys_and_values()
        assert keys.dtype == values.dtype == mx.float16
        assert mx.array_equal(keys, original.keys[:, :, :12]).item()
        assert mx.array_equal(values, original.values[:, :, :12]).item()
    batch = type(rebuilt[0]).merge([rebuilt[0]])
    new = mx.random.normal((1, HEADS, 1, DIM)).astype(mx.float16)
    keys, values = batch.update_and_fetch(new, new)
    assert keys.dtype == mx.float16 and mx.array_equal(keys[:, :, -1:], new).item()
    cache.release(match.blocks)
    cache.ssd.flush()
    cache.close()

    again = prefix_cache(tmp_path, kv_dtype="float16", ssd=10**8)  # a restart: from disk
    again.prefetch(prompt, again.keys(prompt))
    rebuilt = again.acquire(again.match(prompt, again.keys(prompt)))
    assert again.stats()["hits"] == {"ram": 0, "ssd": 1}
    assert rebuilt[2].keys.dtype == mx.float16
    assert mx.array_equal(rebuilt[2].keys_and_values()[1], layers[2].values[:, :, :12]).item()
    again.close()


def test_float32_blocks_on_disk_are_never_loaded_into_a_float16_cache(tmp_path: Path) -> None:
    """A file of an older float32 cache under the same fingerprint (the fingerprint keys the
    KV dtype too: worker/llm_load.py's kv_identity) is deleted on load, not mixed in."""
    old, prompt = stored_ssd(tmp_path)  # float32 blocks
    old.close()
    assert len(files(old)) == 3
    half = prefix_cache(tmp_path, kv_dtype="float16", ssd=10**8)
    assert half.fingerprint == old.fingerprint
    half.prefetch(prompt, half.keys(prompt))
    assert half.match(prompt, half.keys(prompt)).blocks == []
    assert len(files(half)) == 2  # the first block was read, refused and deleted
    half.close()


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_float16_blocks_dequantize_to_float16(tmp_path: Path, bits: int) -> None:
    cache = prefix_cache(tmp_path, kv_dtype="float16", ssd=10**8, kv_bits=bits)
    prompt = list(range(13))
    layers = layers_for(len(prompt), dtype=mx.float16)
    cache.store(prompt, cache.keys(prompt), layers)
    cache.ssd.flush()
    cache.close()
    again = prefix_cache(tmp_path, kv_dtype="float16", ssd=10**8, kv_bits=bits)
    again.prefetch(prompt, again.keys(prompt))
    [first, *_] = again.acquire(again.match(prompt, again.keys(prompt)))
    keys, _ = first.keys_and_values()
    assert keys.dtype == mx.float16
    error = mx.abs(keys.astype(mx.float32) - layers[0].keys[:, :, :12].astype(mx.float32))
    assert mx.max(error).item() < (0.5 if bits == 4 else 0.05)
    again.close()
