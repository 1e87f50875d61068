"""GGUF quant types → MLX affine layout: exact where MLX can hold them, measured where not.

The reference is the `gguf` package's own numpy dequantization of the same bytes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from mlxd.models.gguf import convert_gguf
from mlxd.models.gguf_quants import Converted, convert, pack, requant_bits
from tests.tiny_gguf import random_blocks, tiny_config, tiny_weights, write_gguf

EXACT = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K]
REQUANTIZED = {Q.Q6_K: (8, 0.01), Q.Q3_K: (5, 0.08), Q.Q2_K: (4, 0.15), Q.IQ4_NL: (6, 0.03)}
REQUANTIZED.update({Q.IQ4_XS: (6, 0.03), Q.IQ2_XXS: (4, 0.15), Q.IQ3_S: (5, 0.06)})


def dequantized(converted: Converted) -> np.ndarray:
    """mx.dequantize of an imported tensor, scales and biases in float32 as the CPU runs them."""
    return np.array(
        mx.dequantize(
            converted.weight,
            converted.scales.astype(mx.float32),
            converted.biases.astype(mx.float32),
            group_size=32,
            bits=converted.bits,
        )
    )


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_matches_mlx_layout(bits: int) -> None:
    codes = np.random.default_rng(bits).integers(0, 2**bits, (3, 64), dtype=np.uint8)
    ones, zeros = mx.ones((3, 2)), mx.zeros((3, 2))
    unpacked = mx.dequantize(mx.array(pack(codes, bits)), ones, zeros, group_size=32, bits=bits)
    np.testing.assert_array_equal(np.array(unpacked), codes.astype(np.float32))


@pytest.mark.parametrize("qtype", EXACT, ids=lambda q: q.name)
def test_exact_types_equal_the_reference(qtype: Q) -> None:
    # Expert-shaped (2, 8, 512): leading axes are kept, rows convert independently.
    raw = random_blocks(qtype, 16, 512).reshape(2, 8, -1)
    converted = convert(raw, qtype, (2, 8, 512))
    assert converted.exact and converted.weight.dtype == mx.uint32
    assert converted.scales is not None and converted.scales.shape == (2, 8, 16)
    reference = gguf.quants.dequantize(raw, qtype)
    np.testing.assert_array_equal(dequantized(converted), reference)


@pytest.mark.parametrize(
    ("qtype", "scale_dtype"),
    [(Q.Q4_0, mx.float16), (Q.Q8_0, mx.float16), (Q.Q4_1, mx.float16), (Q.Q4_K, mx.float32)],
)
def test_scales_stay_float16_where_that_is_exact(qtype: Q, scale_dtype: mx.Dtype) -> None:
    converted = convert(random_blocks(qtype, 4, 256), qtype, (4, 256))
    assert converted.scales is not None and converted.scales.dtype == scale_dtype


@pytest.mark.parametrize("qtype", list(REQUANTIZED), ids=lambda q: q.name)
def test_requantized_types_state_their_error(qtype: Q) -> None:
    bits, bound = REQUANTIZED[qtype]
    raw = random_blocks(qtype, 8, 512)
    converted = convert(raw, qtype, (8, 512))
    assert requant_bits(qtype) == bits == converted.bits
    assert not converted.exact
    reference = gguf.quants.dequantize(raw, qtype)
    error = np.linalg.norm(dequantized(converted) - reference) / np.linalg.norm(reference)
    assert converted.rel_error == pytest.approx(error, rel=1e-3)
    assert 0 < converted.rel_error < bound


@pytest.mark.parametrize(("qtype", "dtype"), [(Q.F16, mx.float16), (Q.BF16, mx.bfloat16)])
def test_float_types_keep_their_dtype(qtype: Q, dtype: mx.Dtype) -> None:
    values = np.random.default_rng(0).normal(size=(4, 32)).astype(np.float32)
    raw = values.astype(np.float16) if qtype == Q.F16 else (values.view(np.uint32) >> 16)
    raw = raw.astype(np.uint16 if qtype == Q.BF16 else np.float16).view(np.uint8)
    converted = convert(raw, qtype, (4, 32))
    assert converted.weight.dtype == dtype and converted.scales is None
    np.testing.assert_array_equal(
        np.array(converted.weight.astype(mx.float32)), gguf.quants.dequantize(raw, qtype)
    )


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_imported_model_holds_the_file_values(
    tmp_path: Path, qtype: Q, caplog: pytest.LogCaptureFixture
) -> None:
    config = tiny_config(
        "llama", hidden_size=256, intermediate_size=512, head_dim=64, num_hidden_layers=1
    )
    held = write_gguf(tmp_path / "m.gguf", config, tiny_weights(config), qtype)
    out = tmp_path / "out"
    out.mkdir()
    with caplog.at_level(logging.WARNING, logger="mlxd.models.gguf"):
        convert_gguf(tmp_path / "m.gguf", out)
    quantization = json.loads((out / "config.json").read_text())["quantization"]
    weights = mx.load(str(out / "model.safetensors"))
    for name, reference in held.items():
        if reference.ndim < 2:
            continue
        module = name.removesuffix(".weight")
        values = mx.dequantize(
            weights[name],
            weights[f"{module}.scales"].astype(mx.float32),
            weights[f"{module}.biases"].astype(mx.float32),
            group_size=32,
            bits=quantization["bits"],
        )
        if qtype == Q.Q4_K:  # q/k rows were un-permuted: still the very same values
            np.testing.assert_array_equal(np.array(values), reference)
        else:
            error = np.linalg.norm(np.array(values) - reference) / np.linalg.norm(reference)
            assert error < REQUANTIZED[qtype][1]
    if qtype == Q.Q6_K:
        assert "Q6_K tensors requantized to 8-bit groups of 32" in caplog.text
        assert "relative RMS error" in caplog.text
    else:
        assert "requantized" not in caplog.text
