"""The kernels' weight layouts: `pack` (the float path's) and `pack_dot` (the int8 dot
products'), the experts' stacks, and lookups from either (`take_rows`). Described here, written by
csrc/convert.cpp and multiplied by the rest of csrc/.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field

import mlx.core as mx

BLOCK = 32  # inputs per step of the kernels' loops; a scale and bias serve one or more
LANES = 16  # output rows per tile
# The width the kernels run each width MLX stores at: a 2- or 3-bit value fits a nibble and a
# 5- or 6-bit one a byte, with the same scale and bias, so widening is exact (a Q5_K GGUF
# imports at 5 bits; mlx-community's 3- and 6-bit recipes). Memory: 4 or 8 bits a weight.
KERNEL_BITS = {2: 4, 3: 4, 4: 4, 5: 8, 6: 8, 8: 8}


@dataclass(frozen=True)
class Packed:
    """Weights [N, K] in the kernel's layout, or a stack of E such (`pack_experts`): [E, N, K]."""

    weight: mx.array  # uint8 [(E,) N, K * bits / 8], tiled
    scale_bias: mx.array  # float16 or float32 [(E,) N / 16, K / group, 2 (scale, bias), 16]
    bits: int
    dot: bool = False  # pack_dot's layout: multiplied by integer dot products
    precise: bool = False  # (dot) x as two int8 terms: its rounding's rest as well
    # Where these are rows [first_row, …) of a bigger matrix in the same layout (a layer's q,
    # k and v projections kept as one: models/packed_cache.py), that one: views of its memory,
    # whose fusion (models/fused.py) is that matrix, not a copy.
    whole: Packed | None = field(default=None, compare=False, repr=False)
    first_row: int = 0

    def rows(self, first: int, count: int) -> Packed:
        """Output rows [first, first + count) of this matrix (whole tiles) as views of its
        memory, which they name as their `whole`."""
        tiles = slice(first // LANES, (first + count) // LANES)
        weight, scale_bias = self.weight[first : first + count], self.scale_bias[tiles]
        return Packed(weight, scale_bias, self.bits, self.dot, self.precise, self, first)

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K): one matrix's (an expert's, for a stack)."""
        return self.weight.shape[-2], self.weight.shape[-1] * 8 // self.bits

    @property
    def group(self) -> int:
        """Inputs sharing a scale and bias (`scale_group` of the quantization's group)."""
        return self.shape[1] // self.scale_bias.shape[-3]


def scale_group(group_size: int) -> int:
    """The inputs a packed scale and bias serve for a quantization `group_size` (a multiple
    of BLOCK): the group itself where the kernels step it (BLOCK times a power of two: 32, 64,
    128), else its largest such divisor. One pair per 64 inputs, not per 32, is 4.5 bits a
    4-bit weight instead of 5: a tenth fewer bytes for a decode step to stream."""
    group = BLOCK
    while group_size % (2 * group) == 0:
        group *= 2
    return group


def packable(rows: int, group_size: int, bits: int) -> bool:
    """Whether `pack` takes an MLX-quantized matrix with this many (output) rows, group size
    and width (rows: the kernel works on pairs of 16-row tiles)."""
    return why_not_packable(rows, group_size, bits) is None


def why_not_packable(rows: int, group_size: int, bits: int) -> str | None:
    """What keeps `pack` from taking such a matrix, in a few words (None: nothing)."""
    if bits not in (4, 8):
        return f"{bits}-bit (the kernels take 4 and 8)"
    if group_size % BLOCK:
        return f"groups of {group_size} (the kernels take multiples of {BLOCK})"
    if rows % (2 * LANES):
        return f"{rows} output rows (the kernels take multiples of {2 * LANES})"
    return None


def pack(
    weight: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> Packed:
    """MLX's quantized layout (`mx.quantize`, or a GGUF as mx.load reads it) → `Packed`.

    The kernel's layout (see csrc/qmatmul.cpp): output rows in tiles of 16, each tile's values
    for one input (8 bits) or two inputs (4 bits, low and high nibble) in 16 consecutive bytes;
    per tile and group of inputs (`scale_group`) 16 scales then 16 biases, in float16 when that
    holds them exactly (a Q4_0 or Q8_0 GGUF's do), else float32.
    """
    return _pack_rows(weight, scales, biases, group_size, bits)


def pack_dot(
    weight: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    precise: bool = False,
    round_scales: bool = False,
) -> Packed:
    """MLX's quantized layout → `Packed` for the integer dot-product kernel (csrc/qdot.cpp):
    output rows in tiles of 16, each row's values of 4 consecutive inputs in one 32-bit lane:
    per tile and 4 inputs (8 bits) 64 bytes, bytes 4j..4j+3 row j's; per tile and 8 inputs
    (4 bits) 64 bytes, byte 4j+i = q[j][k+i] | q[j][k+4+i] << 4. Scales and biases as `pack`'s.
    The kernel rounds x to int8 per block of 32 (llama.cpp's Q8: relative error up to 1/254 of
    the block's largest |x|), or with `precise` to two int8 terms (1/64,516) for twice the
    dot products. `round_scales`: scales and biases in float16 even where that rounds them
    (by at most 2^-11), as long as every one is in its range.
    """
    return _pack_rows(weight, scales, biases, group_size, bits, True, precise, round_scales)


def pack_experts(
    weight: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    dot: bool = False,
    precise: bool = False,
    round_scales: bool = False,
) -> Packed:
    """A mixture of experts' stacked matrices as MLX quantizes them (mlx-lm's
    `QuantizedSwitchLinear`: weight [E, N, K * bits / 32] uint32, scales and biases
    [E, N, K / group]) → `Packed` [E, N, K] for `gather_qmatmul`: each expert as `pack` (or with
    `dot` `pack_dot`, `round_scales` as there) lays out one matrix, one after another (tiles
    never straddle two experts: N is a multiple of 32).
    """
    experts, rows = weight.shape[0], weight.shape[1]
    if weight.ndim != 3 or not packable(rows, group_size, bits):
        raise ValueError(f"cannot pack {bits}-bit experts {weight.shape}, group size {group_size}")
    w, s, b = (a.reshape(experts * rows, -1) for a in (weight, scales, biases))
    flat = _pack_rows(w, s, b, group_size, bits, dot, dot and precise, round_scales)
    return Packed(
        flat.weight.reshape(experts, rows, -1),
        flat.scale_bias.reshape(experts, rows // LANES, *flat.scale_bias.shape[1:]),
        bits,
        dot,
        precise,
    )


def take_rows(packed: Packed, ids: mx.array) -> mx.array:
    """Rows `ids` (any shape) of the dequantized matrix, float32 [*ids.shape, K], read from
    the packed layout (`pack`'s or `pack_dot`'s) with MLX ops: an embedding lookup from the
    table that is also the output projection."""
    rows, inputs = packed.shape
    flat = ids.reshape(-1)
    tile, lane = flat // LANES, flat % LANES
    # A row's bytes come in groups, 16 rows' groups side by side: one byte (`pack`) or four
    # (`pack_dot`). [tiles, groups, 16 rows, bytes] → each id's tile, then its lane.
    group = 4 if packed.dot else 1
    data = packed.weight.reshape(rows // LANES, -1, LANES, group)[tile]
    values = mx.take_along_axis(data, lane[:, None, None, None], axis=2)[:, :, 0]
    if packed.bits == 4:  # a group's earlier inputs in its low nibbles, the later in the high
        values = mx.concatenate([values & 0xF, values >> 4], axis=-1)
    values = values.reshape(flat.shape[0], -1, packed.group).astype(mx.float32)
    both = packed.scale_bias[tile]  # [n, groups, 2, 16]
    both = mx.take_along_axis(both, lane[:, None, None, None], axis=3)[..., 0]
    out = values * both[..., 0:1].astype(mx.float32) + both[..., 1:2].astype(mx.float32)
    return out.reshape(*ids.shape, inputs)


def _pack_rows(
    weight: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    dot: bool = False,
    precise: bool = False,
    round_scales: bool = False,
) -> Packed:
    """The layout written by the kernels' module (csrc/convert.cpp) on every core, straight into
    the arrays the model keeps: no temporaries but the float32 scales."""
    if weight.ndim != 2 or not packable(weight.shape[0], group_size, bits):
        raise ValueError(f"cannot pack {bits}-bit weights {weight.shape}, group size {group_size}")
    native = importlib.import_module("mlxd.kernels._cpu")  # only built modules pack
    threads = len(os.sched_getaffinity(0))
    words = weight if weight.dtype == mx.uint32 else weight.astype(mx.uint32)
    tiled = native.tile_weights(words, bits, dot, threads)
    repeats = group_size // scale_group(group_size)
    halves, floats, half = native.tile_scale_pairs(
        scales.astype(mx.float32), biases.astype(mx.float32), repeats, round_scales, threads
    )
    mx.eval(tiled, halves, floats, half)
    return Packed(tiled, halves if half.item() else floats, bits, dot, precise)
