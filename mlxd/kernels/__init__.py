"""mlxd's own CPU kernels for MLX (csrc/, built by `python -m mlxd.kernels.build`).

`qmatmul(x, packed)` multiplies float32 activations with affine-quantized weights (4 or 8 bits)
at the speed the CPU's vector units allow, which MLX 0.32's CPU backend does not: its quantized
matmul is 2-4x slower than float32 BLAS. `pack` rearranges MLX's quantized layout (uint32 words,
groups of 32/64/128) once into the kernel's (bytes in tiles of 16 output rows, scales and
biases per block of 32 inputs); `pack_dot` into the integer dot-product kernel's, which
quantizes x to int8 per block of 32 as llama.cpp does (csrc/qdot.cpp).

The module holds the kernels once per ISA variant (generic, avx2, avxvnni, avx512, avx512vnni
on x86-64; generic, neon, neondot on aarch64) and runs the best one the CPU supports;
`MLXD_KERNELS_ISA` (or `use_isa`) forces one, `isa()` says which runs.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType

import mlx.core as mx
import numpy as np

BLOCK = 32  # inputs per scale and bias in the kernel
LANES = 16  # output rows per tile
PACK_ROWS = 1024  # rows `pack` repacks at a time, a slice per packing thread (a multiple of LANES)


ISA_ENV = "MLXD_KERNELS_ISA"


def _load() -> ModuleType | None:
    """The built module once it multiplies a small matrix right, else None.

    A module built against another MLX (its nanobind ABI decides whether arrays cross at all)
    fails here instead of at a model's first step. An ISA forced by MLXD_KERNELS_ISA that the
    module or the CPU lacks is an error, not a quiet fallback.
    """
    try:
        module = importlib.import_module("mlxd.kernels._cpu")
    except ImportError:
        return None
    forced = os.environ.get(ISA_ENV)
    if forced:
        try:
            module.use_isa(forced)
        except ValueError as error:
            raise RuntimeError(f"{ISA_ENV}={forced}: {error}") from None
    try:
        w = mx.arange(64 * 32, dtype=mx.float32).reshape(64, 32) % 7 - 3
        x = mx.ones((1, 32))
        weight, scales, biases = mx.quantize(w, group_size=32, bits=8)
        packed = pack(weight, scales, biases, group_size=32, bits=8)
        y = module.qmatmul(x, packed.weight, packed.scale_bias, 8)
        expected = x @ mx.dequantize(weight, scales, biases, group_size=32, bits=8).T
        if not mx.allclose(y, expected, atol=1e-4).item():
            return None
    except Exception:  # ImportError, a TypeError from a foreign array type, a kernel bug
        return None
    return module


def available() -> bool:
    """Whether the kernels were built for this machine and load."""
    return _cpu is not None


def isa() -> str | None:
    """The ISA variant the kernels run (avx512, avx2, neon, generic), None when not built."""
    return None if _cpu is None else str(_cpu.isa())


def isas() -> list[str]:
    """The ISA variants this machine can run, best first (none when the kernels are not built)."""
    return [] if _cpu is None else list(_cpu.runnable_isas())


def built_isas() -> list[str]:
    """Every ISA variant the built module holds, best first (what this CPU runs or not)."""
    return [] if _cpu is None else list(_cpu.built_isas())


def use_isa(name: str) -> None:
    """Runs every later kernel on ISA variant `name`; ValueError if the CPU or module lacks it."""
    _module().use_isa(name)


@dataclass(frozen=True)
class Packed:
    """Weights [N, K] in the kernel's layout, or a stack of E such (`pack_experts`): [E, N, K]."""

    weight: mx.array  # uint8 [(E,) N, K * bits / 8], tiled
    scale_bias: mx.array  # float16 or float32 [(E,) N / 16, K / 32, 2 (scale, bias), 16]
    bits: int
    dot: bool = False  # pack_dot's layout: multiplied by integer dot products
    precise: bool = False  # (dot) x as two int8 terms: its rounding's rest as well

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K): one matrix's (an expert's, for a stack)."""
        return self.weight.shape[-2], self.weight.shape[-1] * 8 // self.bits


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
    per tile and block of 32 inputs 16 scales then 16 biases, in float16 when that holds them
    exactly (a GGUF's do), else float32.
    """
    return _pack_rows(weight, scales, biases, group_size, bits, _float_layout)


def pack_dot(
    weight: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    precise: bool = False,
) -> Packed:
    """MLX's quantized layout → `Packed` for the integer dot-product kernel (csrc/qdot.cpp):
    output rows in tiles of 16, each row's values of 4 consecutive inputs in one 32-bit lane:
    per tile and 4 inputs (8 bits) 64 bytes, bytes 4j..4j+3 row j's; per tile and 8 inputs
    (4 bits) 64 bytes, byte 4j+i = q[j][k+i] | q[j][k+4+i] << 4. Scales and biases as `pack`'s.
    The kernel rounds x to int8 per block of 32 (llama.cpp's Q8: relative error up to 1/254 of
    the block's largest |x|), or with `precise` to two int8 terms (1/64,516) for twice the
    dot products.
    """
    return _pack_rows(weight, scales, biases, group_size, bits, _dot_layout, True, precise)


def pack_experts(
    weight: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    dot: bool = False,
    precise: bool = False,
) -> Packed:
    """A mixture of experts' stacked matrices as MLX quantizes them (mlx-lm's
    `QuantizedSwitchLinear`: weight [E, N, K * bits / 32] uint32, scales and biases
    [E, N, K / group]) → `Packed` [E, N, K] for `gather_qmatmul`: each expert as `pack` (or with
    `dot` `pack_dot`) lays out one matrix, one after another (tiles never straddle two experts:
    N is a multiple of 32).
    """
    experts, rows = weight.shape[0], weight.shape[1]
    if weight.ndim != 3 or not packable(rows, group_size, bits):
        raise ValueError(f"cannot pack {bits}-bit experts {weight.shape}, group size {group_size}")
    w, s, b = (a.reshape(experts * rows, -1) for a in (weight, scales, biases))
    layout = _dot_layout if dot else _float_layout
    flat = _pack_rows(w, s, b, group_size, bits, layout, dot, dot and precise)
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
    if packed.dot:
        # [tiles, groups of 4 bytes, 16 rows, 4] (see `pack_dot`) → each id's [groups, 4].
        data = packed.weight.reshape(rows // LANES, -1, LANES, 4)[tile]
        values = mx.take_along_axis(data, lane[:, None, None, None], axis=2)[:, :, 0]
        if packed.bits == 4:  # inputs k..k+3 in the low nibbles, k+4..k+7 in the high
            values = mx.concatenate([values & 0xF, values >> 4], axis=-1)
    else:
        # [tiles, bytes per row, 16 rows] (see `pack`) → the tile of each id, then its lane.
        data = packed.weight.reshape(rows // LANES, -1, LANES)[tile]
        values = mx.take_along_axis(data, lane[:, None, None], axis=2)[..., 0]
        if packed.bits == 4:  # the earlier input in the low nibble
            values = mx.stack([values & 0xF, values >> 4], axis=-1)
    values = values.reshape(flat.shape[0], inputs // BLOCK, BLOCK).astype(mx.float32)
    both = packed.scale_bias[tile]  # [n, blocks, 2, 16]
    both = mx.take_along_axis(both, lane[:, None, None, None], axis=3)[..., 0]
    out = values * both[..., 0:1].astype(mx.float32) + both[..., 1:2].astype(mx.float32)
    return out.reshape(*ids.shape, inputs)


Layout = Callable[[np.ndarray, int], np.ndarray]


def _pack_rows(
    weight: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    layout: Layout,
    dot: bool = False,
    precise: bool = False,
) -> Packed:
    """`PACK_ROWS` rows at a time into the result, on a thread per core, so the temporaries
    are a few slices', not a whole tensor's (an 8B's output head: 0.5 GiB)."""
    if weight.ndim != 2 or not packable(weight.shape[0], group_size, bits):
        raise ValueError(f"cannot pack {bits}-bit weights {weight.shape}, group size {group_size}")
    rows, words = weight.shape
    inputs = words * 32 // bits
    # MLX evaluates on this thread (the arrays belong to its stream); numpy on the packers.
    raw = _row_bytes(weight)
    scales32, biases32 = (np.asarray(a.astype(mx.float32)) for a in (scales, biases))
    packed_weight = np.empty((rows, words * 4), np.uint8)
    both = np.empty((rows // LANES, inputs // BLOCK, 2, LANES), np.float32)

    def pack_slice(start: int) -> None:
        stop = min(start + PACK_ROWS, rows)
        tiles = slice(start // LANES, stop // LANES)
        packed_weight[start:stop] = layout(raw[tiles], bits).reshape(stop - start, -1)
        both[tiles] = _scales_biases(scales32[start:stop], biases32[start:stop], group_size)

    for _ in _packers.map(pack_slice, range(0, rows, PACK_ROWS)):
        pass  # raises what a slice raised
    if np.array_equal(both.astype(np.float16).astype(np.float32), both):
        both = both.astype(np.float16)
    packed = Packed(mx.array(packed_weight), mx.array(both), bits, dot, precise)
    mx.eval(packed.weight, packed.scale_bias)
    return packed


def _row_bytes(weight: mx.array) -> np.ndarray:
    """MLX's packed rows as bytes, [N / 16 tiles, 16, K * bits / 8]: little-endian words, so
    each byte holds one 8-bit value or two 4-bit ones, the earlier in the low nibble."""
    raw = np.asarray(weight if weight.dtype == mx.uint32 else weight.astype(mx.uint32))
    rows = raw.shape[0]
    return raw.view(np.uint8).reshape(rows // LANES, LANES, -1)


def _float_layout(tiles: np.ndarray, bits: int) -> np.ndarray:
    # MLX's bytes already pair inputs k and k + 1 of a row as the kernel does (4 bits).
    return np.ascontiguousarray(tiles.transpose(0, 2, 1))


def _dot_layout(tiles: np.ndarray, bits: int) -> np.ndarray:
    count, _, width = tiles.shape
    if bits == 4:
        # Bytes b0..b3 hold inputs k..k+7 in pairs (b0 = q0 | q1 << 4, …); the kernel wants
        # byte i = q[k+i] | q[k+4+i] << 4: nibbles moved between bytes, never split out.
        b0, b1, b2, b3 = (tiles.reshape(count, LANES, width // 4, 4)[..., i] for i in range(4))
        high = np.uint8(0xF0)
        tiles = np.stack(
            [
                (b0 & 0xF) | (b2 << 4),
                (b0 >> 4) | (b2 & high),
                (b1 & 0xF) | (b3 << 4),
                (b1 >> 4) | (b3 & high),
            ],
            axis=-1,
        )
    else:
        tiles = tiles.reshape(count, LANES, width // 4, 4)
    return np.ascontiguousarray(tiles.transpose(0, 2, 1, 3))


def _scales_biases(scales: np.ndarray, biases: np.ndarray, group_size: int) -> np.ndarray:
    """[rows, K / group] → [tiles, K / 32 blocks, 2, 16]: each tile's 16 scales, then biases."""
    both = np.stack([scales, biases])
    rows = both.shape[1]
    both = np.repeat(both, group_size // BLOCK, axis=2).reshape(2, rows // LANES, LANES, -1)
    return both.transpose(1, 3, 0, 2)


_packers = ThreadPoolExecutor(len(os.sched_getaffinity(0)), thread_name_prefix="pack")
_cpu = _load()


def _module() -> ModuleType:
    if _cpu is None:
        raise RuntimeError("mlxd's CPU kernels are not built: python -m mlxd.kernels.build")
    return _cpu


def qmatmul(x: mx.array, packed: Packed) -> mx.array:
    """x [..., K] @ dequantize(packed).T in float32 (CPU stream)."""
    result: mx.array = _module().qmatmul(
        x, packed.weight, packed.scale_bias, packed.bits, packed.dot, packed.precise
    )
    return result


def gather_qmatmul(x: mx.array, indices: mx.array, experts: Packed) -> mx.array:
    """y[t, j] = x[t] @ dequantize(experts[indices[t, j]]).T for x [T, K] and integer indices
    [T, J]: float32 [T, J, N] (CPU stream). An index outside the stack gives zeros."""
    result: mx.array = _module().gather_qmatmul(
        x, indices, experts.weight, experts.scale_bias, experts.bits, experts.dot, experts.precise
    )
    return result


def integer_dot() -> bool:
    """Whether the ISA variant in use multiplies `pack_dot`'s layout by integer dot products
    (VNNI, vpmaddubsw, sdot); the generic variant's scalar loop is for correctness only."""
    return _cpu is not None and bool(_cpu.integer_dot())


def rope(
    x: mx.array, inv_freq: mx.array, offsets: mx.array, dims: int, traditional: bool, scale: float
) -> mx.array:
    """mx.fast.rope's rotation of float32 x [B, H, L, D] at positions offsets[b] + l."""
    result: mx.array = _module().rope(x, inv_freq, offsets, dims, traditional, scale)
    return result


def attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | str | None
) -> mx.array:
    """mx.fast.scaled_dot_product_attention for float32 q and k, v [B, H, L, D] both float32
    or both float16 (a 16-bit KV cache), no sinks; float32 out."""
    if _cpu is None:
        raise RuntimeError("mlxd's CPU kernels are not built: python -m mlxd.kernels.build")
    causal = isinstance(mask, str)
    if causal and mask != "causal":
        raise ValueError(f"unknown mask {mask!r}")
    result: mx.array = _module().attention(q, k, v, scale, None if causal else mask, causal)
    return result


_blas_in_process = False


def share_cores(packed: bool) -> None:
    """Called at each model load: the kernels use every core while this process's models all
    run packed, one thread once any does its matmuls on OpenBLAS (float32): OpenBLAS's
    threads and the kernels' would spin against each other (csrc/threads.h)."""
    global _blas_in_process
    _blas_in_process |= not packed
    if _cpu is not None:
        _cpu.set_threads(1 if _blas_in_process else len(os.sched_getaffinity(0)))


def set_threads(threads: int) -> None:
    """The kernels run on `threads` threads until the next `share_cores` (tests, benchmarks,
    the load's timing of the CPU path: models/cpu_path_timing.py)."""
    _module().set_threads(threads)


def set_spare_core_rows(rows: int) -> None:
    """Kernels over at most `rows` rows of x leave one core to the rest of the process (0:
    none do; see models/cpu_path.py `Choice.spares_a_core`)."""
    _module().set_spare_core_rows(rows)


def threads_for_rows(rows: int) -> int:
    """How many threads a kernel over `rows` rows of x on this thread's CPU stream uses."""
    threads: int = _module().threads_for_rows(rows)
    return threads


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x for float32 gate and x of one shape, with models.activations' rational
    SiLU: one graph node where the compiled form is five."""
    result: mx.array = _module().swiglu(gate, x)
    return result


def parallelize_this_thread() -> None:
    """From now on only kernels evaluated on this thread's default CPU stream use several
    threads (an engine's model thread); a kernel on another stream while the pool is busy
    would run alone anyway (csrc/threads.cpp)."""
    if _cpu is not None:
        _cpu.parallelize_default_stream()


def assemble_kv(blocks: list[mx.array], capacity: int) -> list[mx.array]:
    """One [1, H, capacity, D] buffer per layer from blocks [L, H, T, D] in position order
    (their positions first, zeros after)."""
    result: list[mx.array] = _module().assemble_kv(blocks, capacity)
    return result


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """mx.fast.rms_norm for float32 x [..., D] and weight [D]."""
    result: mx.array = _module().rms_norm(x, weight, eps)
    return result


def sample(
    logits: mx.array, inv_temperature: mx.array, top_p: mx.array, uniform: mx.array
) -> mx.array:
    """A token per row of logits [n, V] (any float type), uint32 [n], from per-row
    inv_temperature, top_p and uniform [n] (in [0, 1)): among the row's top-p nucleus of the
    untempered distribution (mlx-lm's `apply_top_p`; all tokens at top_p 1), weighted
    e^((x - max) * inv_temperature), the first in index order whose cumulative weight passes
    uniform of their total (CPU stream, lazy)."""
    result: mx.array = _module().sample(logits, inv_temperature, top_p, uniform)
    return result
