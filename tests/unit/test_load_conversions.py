"""The load-time conversions the kernels' module does (csrc/convert.cpp) against numpy's
statements of the same layouts: MLX's quantized rows into the kernels' tiles, scales and biases
into theirs, GGUF blocks of every exact type into MLX's affine groups (the numpy path's).
Any byte out of place fails."""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from mlxd import kernels
from mlxd.kernels import LANES
from mlxd.models import gguf_quants
from tests.tiny_gguf import random_blocks


def float_layout(tiles: np.ndarray) -> np.ndarray:
    """qmatmul's: per tile, each byte column's 16 bytes (one per row) side by side."""
    return np.ascontiguousarray(tiles.transpose(0, 2, 1))


def dot_layout(tiles: np.ndarray, bits: int) -> np.ndarray:
    """qdot's: per tile, each 32-bit column's 16 words side by side; 4-bit bytes b0..b3 (inputs
    k..k+7 in pairs) regrouped so that byte i holds inputs k+i (low) and k+4+i (high)."""
    count, _, width = tiles.shape
    words = tiles.reshape(count, LANES, width // 4, 4)
    if bits == 4:
        b0, b1, b2, b3 = (words[..., i] for i in range(4))
        high = np.uint8(0xF0)
        words = np.stack(
            [
                (b0 & 0xF) | (b2 << 4),
                (b0 >> 4) | (b2 & high),
                (b1 & 0xF) | (b3 << 4),
                (b1 >> 4) | (b3 & high),
            ],
            axis=-1,
        )
    return np.ascontiguousarray(words.transpose(0, 2, 1, 3))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dot", [False, True])
def test_weights_are_tiled_as_the_layout_says(bits: int, dot: bool) -> None:
    # Enough tiles for every packing thread to write some.
    rows, inputs = 1088, 256
    weight, scales, biases = mx.quantize(mx.random.normal((rows, inputs)), 32, bits)
    packed = (kernels.pack_dot if dot else kernels.pack)(weight, scales, biases, 32, bits)
    tiles = np.asarray(weight).view(np.uint8).reshape(rows // LANES, LANES, -1)
    expected = dot_layout(tiles, bits) if dot else float_layout(tiles)
    np.testing.assert_array_equal(np.asarray(packed.weight), expected.reshape(rows, -1))


@pytest.mark.parametrize(("group_size", "repeats"), [(32, 1), (64, 1), (96, 3)])
def test_scales_and_biases_are_tiled_and_repeated(group_size: int, repeats: int) -> None:
    # Groups of 96 (no MLX recipe, but a multiple of 32) are stepped as three of 32: each pair
    # repeated.
    rows, inputs = 64, 192
    weight = mx.quantize(mx.random.normal((rows, inputs)), 32, 8)[0]
    scales, biases = (mx.random.normal((rows, inputs // group_size)) for _ in range(2))
    packed = kernels.pack(weight, scales, biases, group_size, 8)
    both = np.stack([np.asarray(scales.astype(mx.float32)), np.asarray(biases)])
    both = np.repeat(both, repeats, axis=2).reshape(2, rows // LANES, LANES, -1)
    expected = both.transpose(1, 3, 0, 2)
    np.testing.assert_array_equal(np.asarray(packed.scale_bias.astype(mx.float32)), expected)


def test_scales_stay_float16_only_where_every_value_is_one() -> None:
    weight, scales, biases = mx.quantize(mx.random.normal((32, 64)), 32, 4)
    halves = [a.astype(mx.float16).astype(mx.float32) for a in (scales, biases)]
    assert kernels.pack(weight, *halves, 32, 4).scale_bias.dtype == mx.float16
    # One value a float16 cannot hold (its 10 mantissa bits step by 2^-12 for scales near 0.3).
    scales = halves[0].at[3, 1].add(2.0**-20)
    assert kernels.pack(weight, scales, halves[1], 32, 4).scale_bias.dtype == mx.float32


def test_scales_rounded_to_float16_as_numpy_rounds_them() -> None:
    # Magnitudes from below float16's least subnormal to its largest value, and exact ties
    # (to even), written as float16 by the tiling itself: bit for bit numpy's rounding.
    rng = np.random.default_rng(5)
    rows, groups = 32, 64
    values = np.sign(rng.standard_normal((rows, groups))) * 2.0 ** rng.uniform(
        -27, 15.9, (rows, groups)
    )
    values[0, :10] = [
        2**-25,
        3 * 2**-25,
        2**-24 * 1.5,
        1 + 2**-11,
        1 + 3 * 2**-11,
        2**-14 * (1 - 2**-11),
        65504,
        65519,
        -0.0,
        0,
    ]
    values = values.astype(np.float32)
    scales, biases = mx.array(values), mx.array(np.ascontiguousarray(values[::-1]))
    weight = mx.zeros((rows, groups * 32 * 4 // 32), mx.uint32)
    packed = kernels.pack_dot(weight, scales, biases, 32, 4, round_scales=True)
    assert packed.scale_bias.dtype == mx.float16
    both = np.stack([np.asarray(scales), np.asarray(biases)]).reshape(2, rows // LANES, LANES, -1)
    expected = both.transpose(1, 3, 0, 2).astype(np.float16)
    got = np.asarray(packed.scale_bias)
    np.testing.assert_array_equal(got.view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize(
    "qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K], ids=lambda q: q.name
)
def test_exact_types_on_the_kernels_equal_numpy_bit_for_bit(qtype: Q) -> None:
    assert kernels.available(), "the kernels' module did not build: python -m mlxd.kernels.build"
    raw = random_blocks(qtype, 32, 1024, seed=3)
    native = gguf_quants.convert(raw, qtype, (32, 1024))
    numpy = gguf_quants._convert_exact(raw, qtype, (32, 1024))
    for ours, theirs in zip(
        (native.weight, native.scales, native.biases),
        (numpy.weight, numpy.scales, numpy.biases),
        strict=True,
    ):
        assert ours is not None and theirs is not None
        assert ours.dtype == theirs.dtype
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert native.exact and native.bits == numpy.bits


def test_q6_k_on_the_kernels_states_the_error_of_every_value() -> None:
    raw = random_blocks(Q.Q6_K, 48, 512, seed=5)
    converted = gguf_quants.convert(raw, Q.Q6_K, (48, 512))
    assert converted.scales is not None and converted.biases is not None
    back = mx.dequantize(converted.weight, converted.scales, converted.biases, 32, 8)
    reference = gguf.quants.dequantize(raw, Q.Q6_K)
    error = np.linalg.norm(np.asarray(back) - reference) / np.linalg.norm(reference)
    assert converted.rel_error == pytest.approx(error, rel=1e-4)
    # Half a step of 255 over each group's range: well under the 6-bit grid's own.
    assert 0 < converted.rel_error < 0.006


def test_a_strided_weight_is_tiled_as_its_copy() -> None:
    weight, scales, biases = mx.quantize(mx.random.normal((64, 512)), 32, 4)
    # The first 256 inputs: a view whose rows are 64 words apart, not 32.
    view, s, b = weight[:, :32], scales[:, :8], biases[:, :8]
    copy = mx.array(np.asarray(view))
    for dot in (False, True):
        pack = kernels.pack_dot if dot else kernels.pack
        np.testing.assert_array_equal(
            np.asarray(pack(view, s, b, 32, 4).weight), np.asarray(pack(copy, s, b, 32, 4).weight)
        )


def widened(weight: np.ndarray, bits: int, width: int) -> np.ndarray:
    """The numpy statement: each row's little-endian `bits`-bit stream, every value's bits
    padded with zeros to `width`, packed again."""
    rows, words = weight.shape
    values = words * 32 // bits
    stream = np.unpackbits(weight.view(np.uint8), axis=1, bitorder="little")
    padded = np.pad(stream.reshape(rows, values, bits), ((0, 0), (0, 0), (0, width - bits)))
    return np.packbits(padded.reshape(rows, -1), axis=1, bitorder="little").view(np.uint32)


@pytest.mark.parametrize(("bits", "width"), [(2, 4), (3, 4), (5, 8), (6, 8)])
def test_narrow_widths_widen_as_numpy_says(bits: int, width: int) -> None:
    weight = np.random.default_rng(bits).integers(0, 2**32, (48, 3 * bits), dtype=np.uint32)
    ours = kernels.widen(mx.array(weight), bits, width)
    np.testing.assert_array_equal(np.asarray(ours), widened(weight, bits, width))
    # A strided view: read in row order, as its copy.
    view = mx.array(np.concatenate([weight, weight], axis=1))[:, ::2]
    expected = widened(
        np.ascontiguousarray(np.concatenate([weight, weight], axis=1)[:, ::2]), bits, width
    )
    np.testing.assert_array_equal(np.asarray(kernels.widen(view, bits, width)), expected)
