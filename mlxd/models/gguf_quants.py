"""GGUF tensor data → MLX weights, one tensor at a time, without a float detour.

MLX's affine quantization stores each group of 32 values as `bits`-bit codes q (a little-endian bit
stream in uint32 words) with a scale and a bias: w = scale * q + bias. Every legacy GGUF block
(Q4_0 … Q8_0) is exactly that with group 32, and so are Q4_K and Q5_K: their super-block of 256
holds eight sub-blocks of 32 whose 6-bit scale and min fold into one scale and bias each. Those are
copied code for code ("exact": dequantized they equal the `gguf` package's own dequantization).

Q6_K, Q3_K and Q2_K use sub-blocks of 16 and the IQ types non-linear codebooks, which MLX cannot
express (its smallest group is 32): those are dequantized chunk by chunk with the `gguf` package and
requantized to an MLX width above their own (REQUANT_BITS), and the error is measured.

The two types of a Q4_K_M file (most of what people download), Q4_K and Q6_K (its output head, half
its down projections), and Q5_K, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 go through the kernels' module
where it is built (csrc/convert.cpp): one pass each instead of a dozen numpy ones, the package's
dequantization and MLX's quantize (on two AVX2 cores: an 8B Q4_K_M 37 → 14 s; a 1B's whole
conversion, Q8_0 8.5–10 → 2.7–3.3 s, Q5_K_M 14.3–16.3 → 6.9–7.4 s).
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from mlxd import kernels
from mlxd.models.gguf_errors import UnsupportedQuantType

GROUP_SIZE = 32
Q = GGMLQuantizationType
FLOAT_TYPES = {Q.F32: np.float32, Q.F16: np.float16, Q.BF16: np.uint16}
EXACT_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K})
MLX_BITS = (2, 3, 4, 5, 6, 8)
# Converted by the kernels' module where it is built (csrc/convert.cpp): exactly, at these widths
# (Q6_K: requantized).
ON_KERNELS = {
    **dict.fromkeys([Q.Q4_0, Q.Q4_1, Q.Q4_K], 4),
    **dict.fromkeys([Q.Q5_0, Q.Q5_1, Q.Q5_K], 5),
    Q.Q8_0: 8,
    Q.Q6_K: 8,
}
# Their scales are a block's float16 d, and their biases a float16 (Q4_1's and Q5_1's m) or -8 d,
# -16 d or -128 d: float16s themselves unless that overflows one.
_HALF_SCALES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0})
# Rows converted at once: bounds the temporary arrays of one large tensor (~8 MiB of blocks),
# and splits it for the decoding threads.
_CHUNK_BYTES = 8 << 20
_THREADS = len(os.sched_getaffinity(0))
_decoders = ThreadPoolExecutor(_THREADS, thread_name_prefix="gguf-decode")
T = TypeVar("T")
# Blocks a requantized tensor's error is measured on (its first rows).
ERROR_SAMPLE_BYTES = 4 << 20


@dataclass
class Converted:
    """One tensor in MLX form: a float array, or packed codes with per-32 scales and biases."""

    weight: mx.array
    scales: mx.array | None = None
    biases: mx.array | None = None
    bits: int | None = None
    exact: bool = True
    rel_error: float = 0.0  # relative RMS error against the GGUF values (requantized only)


def scales_dtype(qtype: GGMLQuantizationType) -> str:
    """The safetensors dtype the conversion gives a quantized tensor's scales and biases:
    float16 for the legacy types, whose values are float16s (unless a bias overflows one,
    which no header tells), float32 for the others."""
    return "F16" if qtype in _HALF_SCALES else "F32"


def requant_bits(qtype: GGMLQuantizationType) -> int:
    """MLX width for a type MLX cannot hold exactly: above its own bits per weight.

    At least one bit of headroom over the source's (rounded-up) bits per weight, so the grid of the
    new codes is finer than the one it approximates (Q2_K → 4, Q3_K → 5, Q6_K → 8, IQ4_XS → 6).
    """
    block, size = GGML_QUANT_SIZES[qtype]
    wanted = math.ceil(8 * size / block) + 1
    return next((bits for bits in MLX_BITS if bits >= wanted), 8)


def is_supported(qtype: GGMLQuantizationType) -> bool:
    """Whether this importer reads `qtype` (exactly, as a float, or by requantizing)."""
    if qtype in FLOAT_TYPES or qtype in EXACT_TYPES:
        return True
    block, size = GGML_QUANT_SIZES.get(qtype, (0, 0))
    if block % GROUP_SIZE:
        return False
    try:  # the reference dequantizer exists for this type
        dequantize(np.zeros((1, size), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes (..., n) below 2**bits packed as MLX packs them: a little-endian bit stream."""
    codes = codes.astype(np.uint8, copy=False)
    lead = codes.shape[:-1]
    if bits == 8:
        return np.ascontiguousarray(codes).view(np.uint32)
    if bits == 4:
        pairs = codes.reshape(*lead, -1, 2)
        return np.ascontiguousarray(pairs[..., 0] | (pairs[..., 1] << 4)).view(np.uint32)
    # Eight codes fill `bits` whole bytes: build them in a uint64 and keep its low bytes.
    eights = codes.reshape(*lead, -1, 8).astype(np.uint64)
    shifts = np.arange(8, dtype=np.uint64) * np.uint64(bits)
    words = np.bitwise_or.reduce(eights << shifts, axis=-1)
    stream = words[..., None].view(np.uint8)[..., :bits]
    return np.ascontiguousarray(stream).reshape(*lead, -1).view(np.uint32)


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, as float32 (n, 1)."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Legacy blocks: low nibbles are values 0-15, high nibbles 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Bit j of the little-endian bytes `qh` for every j: (n, 8 * len)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """K-quants: each 32 bytes hold sub-block 2i in the low and 2i+1 in the high nibbles."""
    n = qs.shape[0]
    chunks = qs.reshape(n, -1, 1, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=2).reshape(n, -1)


def _paired_nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """4-bit codes stored as GGUF stores them, each `run` bytes holding `run` values in their low
    nibbles then the next `run` in their high ones, as MLX's words (n, bytes / 4): byte j of
    a run of values is value 2j | value 2j+1 << 4. Whole bytes move; no value is split out."""
    n = qs.shape[0]
    spans = qs.reshape(n, -1, run)
    even, odd = spans[..., 0::2], spans[..., 1::2]
    low = (even & 0x0F) | (odd << 4)
    high = (even >> 4) | (odd & np.uint8(0xF0))
    return np.ascontiguousarray(np.concatenate([low, high], axis=-1)).reshape(n, -1).view(np.uint32)


def _exact_blocks(
    blocks: np.ndarray, qtype: GGMLQuantizationType
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(MLX words (n, block * bits / 32), scales (n, block/32), biases, bits) of exact-format
    blocks."""
    n = blocks.shape[0]
    if qtype == Q.Q4_0:
        d = _half(blocks, 0)
        return _paired_nibbles(blocks[:, 2:], 16), d, -8 * d, 4
    if qtype == Q.Q4_1:
        return _paired_nibbles(blocks[:, 4:], 16), _half(blocks, 0), _half(blocks, 2), 4
    if qtype == Q.Q5_0:
        d = _half(blocks, 0)
        codes = _nibbles(blocks[:, 6:]) | (_high_bits(blocks[:, 2:6]) << 4)
        return pack(codes, 5), d, -16 * d, 5
    if qtype == Q.Q5_1:
        codes = _nibbles(blocks[:, 8:]) | (_high_bits(blocks[:, 4:8]) << 4)
        return pack(codes, 5), _half(blocks, 0), _half(blocks, 2), 5
    if qtype == Q.Q8_0:
        d = _half(blocks, 0)
        # int8 + 128 as uint8 is the int8 with its sign bit flipped.
        return pack(blocks[:, 2:] ^ np.uint8(0x80), 8), d, -128 * d, 8
    # Q4_K / Q5_K: d, dmin, 12 bytes of packed 6-bit scales and mins, [qh,] qs.
    sc, mins = Q4_K.get_scale_min(blocks[:, 4:16])
    scales = _half(blocks, 0) * sc.reshape(n, 8).astype(np.float32)
    biases = -(_half(blocks, 2) * mins.reshape(n, 8).astype(np.float32))
    if qtype == Q.Q4_K:
        return _paired_nibbles(blocks[:, 16:], 32), scales, biases, 4
    # Q5_K: bit i of each of the 32 qh bytes is the fifth bit of sub-block i.
    high = (blocks[:, 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1
    codes = _k_nibbles(blocks[:, 48:]) | (high.transpose(0, 2, 1).reshape(n, -1) << 4)
    return pack(codes, 5), scales, biases, 5


def _narrowed(scales: np.ndarray, biases: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float16 scales and biases where that loses nothing (legacy formats), else float32."""
    half = (scales.astype(np.float16), biases.astype(np.float16))
    with np.errstate(over="ignore"):
        if all(
            np.array_equal(h.astype(np.float32), f)
            for h, f in zip(half, (scales, biases), strict=True)
        ):
            return half
    return scales, biases


def _row_chunks(rows: int, row_bytes: int) -> list[slice]:
    step = max(1, _CHUNK_BYTES // max(row_bytes, 1))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _in_order(job: Callable[[slice], T], chunks: list[slice], ahead: int) -> Iterator[T]:
    """`job(chunk)` for each chunk on the decoding threads, up to `ahead` beyond the one
    being consumed, results in chunk order. Only numpy work runs there (it releases the GIL;
    MLX arrays stay on the calling thread, whose stream they belong to)."""
    pending: deque[Future[T]] = deque()
    for chunk in chunks:
        pending.append(_decoders.submit(job, chunk))
        if len(pending) > ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def convert(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> Converted:
    """Convert one tensor's raw GGUF data (as the gguf package's reader maps it) to MLX.

    `shape` is the logical (row-major) shape, last axis the row length.
    """
    if qtype in FLOAT_TYPES:
        array = np.asarray(data).view(FLOAT_TYPES[qtype]).reshape(shape)
        weight = mx.array(array)
        return Converted(weight.view(mx.bfloat16) if qtype == Q.BF16 else weight)
    if not is_supported(qtype):
        raise UnsupportedQuantType(f"GGML tensor type {qtype.name} is not supported")
    block, size = GGML_QUANT_SIZES[qtype]
    cols = shape[-1]
    rows = data.reshape(-1, cols // block * size)
    if qtype in ON_KERNELS and kernels.available():
        return _convert_on_kernels(rows, qtype, shape)
    if qtype in EXACT_TYPES:
        return _convert_exact(rows, qtype, shape)
    return _requantize(rows, qtype, shape)


def _convert_exact(
    rows: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> Converted:
    size = GGML_QUANT_SIZES[qtype][1]

    def decode(chunk: slice) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        n = chunk.stop - chunk.start
        words, scales, biases, bits = _exact_blocks(
            np.asarray(rows[chunk]).reshape(-1, size), qtype
        )
        return words.reshape(n, -1), scales.reshape(n, -1), biases.reshape(n, -1), bits

    parts = list(_in_order(decode, _row_chunks(*rows.shape), _THREADS))
    bits = parts[0][3]
    weight, scales, biases = (np.concatenate([part[i] for part in parts]) for i in range(3))
    scales, biases = _narrowed(scales, biases)
    lead = shape[:-1]
    return Converted(
        mx.array(weight.reshape(*lead, -1)),
        mx.array(scales.reshape(*lead, -1)),
        mx.array(biases.reshape(*lead, -1)),
        bits,
    )


def _requantize(rows: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> Converted:
    """Requantize chunk by chunk; the error is measured on the first rows (up to
    `ERROR_SAMPLE_BYTES` of blocks, millions of values): measuring cost ≈4x the requantizing of
    as many rows (0.39 vs 0.08 s CPU for 32M values of a Q6_K embedding)."""
    bits = requant_bits(qtype)
    chunks = _row_chunks(*rows.shape)
    parts: list[tuple[mx.array, mx.array, mx.array]] = []
    error = norm = 0.0
    # The next chunk is dequantized (numpy) while MLX requantizes this one.
    floats = _in_order(lambda chunk: dequantize(np.asarray(rows[chunk]), qtype), chunks, 1)
    for values in floats:
        reference = mx.array(values)
        del values
        weight, scales, biases = mx.quantize(reference, group_size=GROUP_SIZE, bits=bits)
        if not parts:
            sample = slice(0, max(1, ERROR_SAMPLE_BYTES // max(rows.shape[1], 1)))
            back = mx.dequantize(
                weight[sample], scales[sample], biases[sample], group_size=GROUP_SIZE, bits=bits
            )
            error = float(np.asarray(mx.sum(mx.square(back - reference[sample]))))
            norm = float(np.asarray(mx.sum(mx.square(reference[sample]))))
        mx.eval(weight, scales, biases)  # and let the float chunk go
        parts.append((weight, scales, biases))
    weight, scales, biases = (mx.concatenate(list(column)) for column in zip(*parts, strict=True))
    lead = shape[:-1]
    return Converted(
        weight.reshape(*lead, -1),
        scales.reshape(*lead, -1),
        biases.reshape(*lead, -1),
        bits,
        exact=False,
        rel_error=math.sqrt(error / norm) if norm else 0.0,
    )


def _convert_on_kernels(
    rows: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> Converted:
    """The exact types at their own widths, Q6_K into 8-bit groups, on the kernels' module,
    chunks of rows on the decoding threads; a Q6_K's error is summed over every value."""
    exact = qtype != Q.Q6_K
    bits = ON_KERNELS[qtype]
    count, row_bytes = rows.shape
    block, size = GGML_QUANT_SIZES[qtype]
    values = row_bytes // size * block
    # Written in place by the decoding threads: MLX's own memory, through numpy views (a numpy
    # array copied into MLX was most of an 8B's conversion, on one thread).
    lead = shape[:-1]
    weight = kernels.empty((*lead, values * bits // 32), mx.uint32)
    scale, bias = (kernels.empty((*lead, values // GROUP_SIZE), mx.float32) for _ in range(2))
    codes = kernels.numpy_view(weight).reshape(count, -1).view(np.uint8)
    scales, biases = (kernels.numpy_view(a).reshape(count, -1) for a in (scale, bias))

    def job(chunk: slice) -> tuple[float, float]:
        arrays = (rows[chunk], codes[chunk], scales[chunk], biases[chunk])
        if exact:
            kernels.to_affine(qtype.name, *arrays)
            return 0.0, 0.0
        return kernels.q6_k_to_affine8(*arrays)

    sums = list(_decoders.map(job, _row_chunks(count, row_bytes)))
    error, norm = (sum(column) for column in zip(*sums, strict=True))
    # Cast by MLX: numpy's, without F16C, took 0.7 s of a 1B's conversion. A K-quant's scales and
    # biases are float16s times 6-bit integers: float32.
    if qtype in _HALF_SCALES and np.abs(biases).max(initial=0.0) <= np.finfo(np.float16).max:
        scale, bias = scale.astype(mx.float16), bias.astype(mx.float16)
    rel_error = math.sqrt(error / norm) if norm else 0.0
    return Converted(weight, scale, bias, bits, exact=exact, rel_error=rel_error)
