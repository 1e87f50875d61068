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
import logging
import os
from types import ModuleType
from typing import BinaryIO

import mlx.core as mx
import numpy as np

# The layouts (kernels/layout.py), under the names the kernels' callers use.
from mlxd.kernels.layout import BLOCK as BLOCK
from mlxd.kernels.layout import KERNEL_BITS as KERNEL_BITS
from mlxd.kernels.layout import LANES as LANES
from mlxd.kernels.layout import Packed as Packed
from mlxd.kernels.layout import pack as pack
from mlxd.kernels.layout import pack_dot as pack_dot
from mlxd.kernels.layout import pack_experts as pack_experts
from mlxd.kernels.layout import packable as packable
from mlxd.kernels.layout import scale_group as scale_group
from mlxd.kernels.layout import take_rows as take_rows
from mlxd.kernels.layout import why_not_packable as why_not_packable

ISA_ENV = "MLXD_KERNELS_ISA"


# Every binding this package calls: a module without one was built from older sources.
_BINDINGS = (
    "assemble_kv", "attention", "built_isas", "dot_buffer_rows", "empty", "gather_qmatmul",
    "integer_dot", "isa", "map_file_arrays", "parallelize_default_stream", "q6_k_to_affine8",
    "qmatmul", "rms_norm", "rope", "rope_qkv", "runnable_isas", "sample", "set_dot_buffer_rows",
    "set_spare_core_rows", "set_threads", "swiglu", "swiglu_halves", "threads_for_rows",
    "tile_scale_pairs", "tile_weights", "to_affine", "use_isa", "widen_weights",
)  # fmt: skip


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
    missing = [name for name in _BINDINGS if not hasattr(module, name)]
    if missing:  # a module built from older sources (make rebuilds it; a copy may be stale)
        logging.getLogger(__name__).warning(
            "mlxd's CPU kernels were built from older sources (no %s): rebuild them with make "
            "or python -m mlxd.kernels.build",
            ", ".join(missing),
        )
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


def rope_qkv(
    qkv: mx.array,
    inv_freq: mx.array,
    offsets: mx.array,
    heads: tuple[int, int],
    dims: int,
    traditional: bool,
    scale: float,
    kv_dtype: mx.Dtype,
) -> tuple[mx.array, mx.array, mx.array]:
    """A fused projection's float32 qkv [B, L, (H + 2 KV) * D] split into q [B, H, L, D] and
    k, v [B, KV, L, D], q and k rotated as `rope` does; k and v in `kv_dtype` (float32 or
    float16). `heads`: (H, KV)."""
    q, k, v = _module().rope_qkv(qkv, inv_freq, offsets, *heads, dims, traditional, scale, kv_dtype)
    return q, k, v


def attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: mx.array | str | None,
    heads_last: bool = False,
) -> mx.array:
    """mx.fast.scaled_dot_product_attention for float32 q and k, v [B, H, L, D] both float32
    or both float16 (a 16-bit KV cache), no sinks; float32 out, [B, H, L, D] or (`heads_last`)
    [B, L, H * D], as an output projection takes it."""
    if _cpu is None:
        raise RuntimeError("mlxd's CPU kernels are not built: python -m mlxd.kernels.build")
    causal = isinstance(mask, str)
    if causal and mask != "causal":
        raise ValueError(f"unknown mask {mask!r}")
    result: mx.array = _module().attention(
        q, k, v, scale, None if causal else mask, causal, heads_last
    )
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
    the load's timing of the CPU path: models/cpu_path_probe.py)."""
    _module().set_threads(threads)


def set_spare_core_rows(rows: int) -> None:
    """Kernels over at most `rows` rows of x leave one core to the rest of the process (0:
    none do; see models/cpu_path.py `Choice.spares_a_core`)."""
    _module().set_spare_core_rows(rows)


def set_dot_buffer_rows(rows: int) -> None:
    """Matmuls on the int8 dot products' layout over at least `rows` rows of x run the float
    path's buffered passes instead, the weights dequantized from that layout (0: none do; see
    models/cpu_path.py `Choice.dot_buffer_rows`)."""
    _module().set_dot_buffer_rows(rows)


def dot_buffer_rows() -> int:
    """What `set_dot_buffer_rows` last set (0 until then)."""
    rows: int = _module().dot_buffer_rows()
    return rows


def threads_for_rows(rows: int) -> int:
    """How many threads a kernel over `rows` rows of x on this thread's CPU stream uses."""
    threads: int = _module().threads_for_rows(rows)
    return threads


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x for float32 gate and x of one shape, with models.activations' rational
    SiLU: one graph node where the compiled form is five."""
    result: mx.array = _module().swiglu(gate, x)
    return result


def swiglu_halves(both: mx.array) -> mx.array:
    """`swiglu` of each row's halves of float32 `both` [..., 2F], a fused gate and up
    projection's output (gate first): [..., F], without slicing it into two copies."""
    result: mx.array = _module().swiglu_halves(both)
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
    uniform of their total (CPU stream, lazy). At inv_temperature inf (temperature 0) the
    row's argmax."""
    result: mx.array = _module().sample(logits, inv_temperature, top_p, uniform)
    return result


def argmax(logits: mx.array) -> mx.array:
    """`mx.argmax(logits, axis=-1)` of float logits [n, V] (the first of equal maxima), uint32
    [n]: the sampling kernel at temperature 0, a vectorised pass per row on every core (MLX's
    CPU argmax is one scalar pass on one core: 1.9 ms for 32 x 49,152 against 0.2)."""
    n = logits.shape[0]
    return sample(
        logits,
        mx.array(np.full(n, np.inf, np.float32)),
        mx.array(np.ones(n, np.float32)),
        mx.array(np.zeros(n, np.float32)),
    )


def q6_k_to_affine8(
    blocks: np.ndarray, codes: np.ndarray, scales: np.ndarray, biases: np.ndarray
) -> tuple[float, float]:
    """GGUF Q6_K `blocks` (uint8, whole blocks of 210 bytes) requantized into MLX 8-bit affine
    groups of 32, written into `codes` (uint8, 256 a block), `scales` and `biases` (float32, 8 a
    block); returns (sum of squared errors, sum of squared values). Releases the GIL."""
    error, norm = _module().q6_k_to_affine8(blocks, codes, scales, biases)
    return float(error), float(norm)


def widen(weight: mx.array, bits: int, width: int) -> mx.array:
    """MLX's packed `bits`-bit weights (uint32 [rows, words]; 2, 3, 5 or 6 bits) as the same
    values packed at `width` bits (4, or 8 for 5 and 6), on every core."""
    result: mx.array = _module().widen_weights(
        weight.astype(mx.uint32), bits, width, len(os.sched_getaffinity(0))
    )
    return result


def empty(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """A new array whose memory is not written yet (MLX fills every array it makes), for a
    conversion to write through a numpy view (`numpy_view`)."""
    result: mx.array = _module().empty(list(shape), dtype)
    return result


def map_arrays(
    file: BinaryIO, arrays: list[tuple[int, tuple[int, ...], mx.Dtype]]
) -> tuple[list[mx.array], bool]:
    """The `arrays` (byte offset, shape, dtype; the 8 bytes before each its byte count, a
    little-endian uint64) of the open `file`, and whether they are its pages (mapped
    copy-on-write, populated from the page cache) or copies (an MLX whose allocator's buffers
    cannot be imitated). The mapping keeps the file: it may be closed, renamed or removed
    after. ValueError: the file does not hold them; RuntimeError: unreadable."""
    specs = [(offset, list(shape), dtype) for offset, shape, dtype in arrays]
    result: tuple[list[mx.array], bool] = _module().map_file_arrays(
        file.fileno(), str(file.name), specs
    )
    return result


def numpy_view(array: mx.array) -> np.ndarray:
    """An evaluated array's memory as a writable numpy array: through the buffer protocol,
    which never copies (`np.array(array, copy=False)` may, under numpy 1)."""
    # MLX arrays export the buffer protocol; their type stubs do not say so.
    return np.asarray(memoryview(array))  # type: ignore[arg-type]


def to_affine(
    qtype: str, blocks: np.ndarray, words: np.ndarray, scales: np.ndarray, biases: np.ndarray
) -> None:
    """GGUF `qtype` ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K" or "Q5_K") `blocks` (uint8,
    whole blocks) as MLX affine groups of 32 at the type's width, exactly, written into `words`
    (uint8), `scales` and `biases` (float32, one a group). Releases the GIL."""
    _module().to_affine(qtype, blocks, words, scales, biases)
