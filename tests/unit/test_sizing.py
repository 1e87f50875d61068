"""A model's memory need from its files' headers: a GGUF sized before it is converted exactly
as its converted directory, the KV of max_batch_size sequences at the full context, the
prefix cache, and the default budget."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlxd import host_memory
from mlxd.config import ModelConfig, ServerConfig
from mlxd.models.estimate import estimate_weight_bytes
from mlxd.models.gguf_header import GGUFFile
from mlxd.models.sizing import dir_geometry, gguf_weights_and_geometry, model_need
from mlxd.models.source_paths import source_path
from tests.unit.conftest import SMOL_GGUF

# SmolLM2-135M: 30 layers, 3 KV heads of 64 dims, keys and values.
SMOL_KV_TOKEN_F32 = 30 * 3 * (64 + 64) * 4


@pytest.mark.parametrize("dtype", ["auto", "float32", "keep"])
def test_a_gguf_is_sized_from_its_header_as_its_conversion_is(smol, dtype: str):
    header = GGUFFile(source_path(SMOL_GGUF, model_name="smol"))
    weights, geometry = gguf_weights_and_geometry(header, dtype, packs=True)
    assert weights == estimate_weight_bytes(smol.path, dtype, packs=True)
    assert geometry == dir_geometry(smol.path)
    assert geometry is not None and geometry.bytes_per_token(4) == SMOL_KV_TOKEN_F32
    assert geometry.context == 8192


def test_the_need_counts_kv_at_full_batch_and_context_and_the_prefix_cache(smol):
    weights, geometry = estimate_weight_bytes(smol.path, "auto"), dir_geometry(smol.path)
    config = ModelConfig.model_validate(
        {"source": SMOL_GGUF, "batch": {"max_batch_size": 8}, "cache": {"ram": "64MiB"}}
    )
    # On the CPU kernels' path the KV is float16 (cache.kv_dtype's default): half of float32.
    config = config.model_copy(
        update={"cache": config.cache.model_copy(update={"kv_dtype": "float32"})}
    )
    need = model_need(config, weights, geometry, extra=1000)
    assert need.kv == 8 * 8192 * SMOL_KV_TOKEN_F32  # the model's own context
    assert need.total == weights + need.kv + 64 * 2**20 + 1000
    assert "KV (8 sequences x 8192 tokens, float32)" in need.describe()
    assert "prefix cache (cache.ram)" in need.describe()

    shorter = config.model_copy(update={"context_length": 512})
    assert model_need(shorter, weights, geometry).kv == 8 * 512 * SMOL_KV_TOKEN_F32
    half = config.model_copy(update={"dtype": "bfloat16"})
    assert model_need(half, weights, geometry).kv == need.kv // 2
    encoder = config.model_copy(update={"kind": "embedding"})
    assert model_need(encoder, weights, geometry).total == weights  # no KV, no prefix cache


def test_an_unset_budget_is_three_quarters_of_the_memory_the_process_may_use():
    assert ServerConfig().budget_bytes == int(host_memory.memory().total * 0.75)
    assert ServerConfig(memory_budget="2GiB").budget_bytes == 2 * 2**30


def test_a_float16_kv_cache_is_counted_at_two_bytes_where_the_kernels_store_it(
    smol, monkeypatch: pytest.MonkeyPatch
):
    """cache.kv_dtype auto (the default) on the CPU kernel path: a llama-family model's KV is
    counted as the loader will store it, float16 where the kernels widen halves in hardware."""
    from mlxd import kernels

    weights, geometry = estimate_weight_bytes(smol.path, "auto"), dir_geometry(smol.path)
    config = ModelConfig.model_validate({"source": SMOL_GGUF, "batch": {"max_batch_size": 4}})
    assert config.cache.kv_dtype == "auto"
    f32 = 4 * 8192 * SMOL_KV_TOKEN_F32
    if kernels.isa() != "generic":
        need = model_need(config, weights, geometry)
        assert need.kv == f32 // 2
        assert "KV (4 sequences x 8192 tokens, float16)" in need.describe()
    # An architecture whose attention stays on MLX keeps the compute dtype (float32).
    assert geometry is not None
    assert model_need(config, weights, replace(geometry, model_type="gemma2")).kv == f32
    # The generic variant (no F16C or NEON) keeps float32 unless the YAML asks for float16.
    monkeypatch.setattr(kernels, "isa", lambda: "generic")
    assert model_need(config, weights, geometry).kv == f32
    half = config.model_copy(
        update={"cache": config.cache.model_copy(update={"kv_dtype": "float16"})}
    )
    assert model_need(half, weights, geometry).kv == f32 // 2
