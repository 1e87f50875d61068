"""A model's memory need from its files' headers: a GGUF sized before it is converted exactly
as its converted directory, the KV of max_batch_size sequences at the full context, the
prefix cache, and the default budget."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from mlxd import host_memory
from mlxd.config import ModelConfig, ServerConfig
from mlxd.models.cpu_path_timing import model_shapes
from mlxd.models.estimate import (
    estimate_weight_bytes,
    headers,
    packed_weight_bytes,
    quantized_shapes,
)
from mlxd.models.gguf_header import GGUFFile
from mlxd.models.kernel_layers import has_kernel_attention
from mlxd.models.sizing import dir_geometry, gguf_headers, gguf_weights_and_geometry, model_need
from mlxd.models.source_paths import source_path
from mlxd.models.sources import resolve_source
from tests.tiny_gguf import tiny_config, tiny_weights, write_gguf
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


@pytest.mark.parametrize(
    ("model_type", "qtype"),
    [
        ("llama", Q.Q4_K),
        ("llama", Q.Q6_K),  # requantized to 8 bits
        ("qwen3", Q.Q5_K),
        ("gemma3_text", Q.Q4_1),  # a tied embedding
        ("qwen3_moe", Q.Q8_0),  # expert stacks
    ],
)
def test_a_ggufs_header_gives_its_conversions_shapes_and_bytes(
    tmp_path: Path, model_type: str, qtype: Q
) -> None:
    """What the CPU path is chosen from before a conversion (models/fresh_weights.py) is what
    the converted directory gives after it: the timings' key and the bytes."""
    config = tiny_config(model_type, hidden_size=256, intermediate_size=512)
    if "moe_intermediate_size" in config:
        config["moe_intermediate_size"] = 512  # not the hidden size: out and in tell apart
    write_gguf(tmp_path / "tiny.gguf", config, tiny_weights(config), qtype)
    model_dir = resolve_source(str(tmp_path / "tiny.gguf"), model_name="tiny", cache_dir=tmp_path)
    header = gguf_headers(GGUFFile(tmp_path / "tiny.gguf"))
    assert quantized_shapes(header) == quantized_shapes(model_dir)
    converted = headers(model_dir).config  # config.json as the conversion wrote it
    assert header.config["model_type"] == converted["model_type"] != ""
    # q, k and v fused in the probe's layer and the KV's float16 counted alike either way
    runs_kernel_attention = model_type in ("llama", "qwen3")
    assert has_kernel_attention(header.config) is runs_kernel_attention
    assert has_kernel_attention(converted) is runs_kernel_attention
    gguf_geometry = gguf_weights_and_geometry(GGUFFile(tmp_path / "tiny.gguf"), "auto", packs=True)[
        1
    ]
    dir_kv = dir_geometry(model_dir)
    assert gguf_geometry is not None and dir_kv is not None
    assert gguf_geometry.kernel_attention is dir_kv.kernel_attention is runs_kernel_attention
    shapes = model_shapes(header)
    assert shapes == model_shapes(model_dir) is not None
    if model_type == "qwen3_moe":  # each stack [E, out, in] apart, with the config's top k
        assert shapes.experts_per_token == config["num_experts_per_tok"] == 2
        experts, moe, hidden = config["num_experts"], config["moe_intermediate_size"], 256
        assert moe != hidden
        assert sorted(e[:3] for e in shapes.experts) == [
            (experts, hidden, moe),
            (experts, moe, hidden),
            (experts, moe, hidden),
        ]
        assert all(out != experts * moe for out, *_ in shapes.layer)
    else:
        assert shapes.experts == () and shapes.experts_per_token == 0
    assert packed_weight_bytes(header) == packed_weight_bytes(model_dir)
    for dtype in ("auto", "float32", "keep"):
        assert estimate_weight_bytes(header, dtype) == estimate_weight_bytes(model_dir, dtype)


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
    assert model_need(config, weights, replace(geometry, kernel_attention=False)).kv == f32
    # The generic variant (no F16C or NEON) keeps float32 unless the YAML asks for float16.
    monkeypatch.setattr(kernels, "isa", lambda: "generic")
    assert model_need(config, weights, geometry).kv == f32
    half = config.model_copy(
        update={"cache": config.cache.model_copy(update={"kv_dtype": "float16"})}
    )
    assert model_need(half, weights, geometry).kv == f32 // 2


def test_a_gguf_whose_config_cannot_be_written_is_still_sized(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The estimate asks the GGUF's config only whether the model runs the kernels' attention:
    where the conversion could not write one, the size comes out all the same, with mlx-lm's
    attention counted (float32 KV), and the conversion reports the file's problems itself."""
    from mlxd.models import sizing
    from mlxd.models.gguf_errors import UnsupportedArchitecture

    config = tiny_config("llama", hidden_size=256, intermediate_size=512)
    write_gguf(tmp_path / "tiny.gguf", config, tiny_weights(config), Q.Q4_0)
    header = GGUFFile(tmp_path / "tiny.gguf")
    _, sized = gguf_weights_and_geometry(header, "auto", packs=True)
    assert sized is not None and sized.kernel_attention is True

    def cannot(*args: object) -> dict:
        raise UnsupportedArchitecture("per-layer llama.attention.head_count_kv is not supported")

    monkeypatch.setattr(sizing, "model_config", cannot)
    # (the config is read once per file object: the one above keeps its own)
    assert gguf_headers(header).config["model_type"] == "llama"
    header = GGUFFile(tmp_path / "tiny.gguf")
    weights, geometry = gguf_weights_and_geometry(header, "auto", packs=True)
    assert weights > 0 and geometry is not None and geometry.kernel_attention is False
    assert gguf_headers(header).config == {}
