"""Time a quantized model's matmuls packed (mlxd's kernels) and float32 (BLAS) at its own
shapes: the child process models/cpu_path_timing.py starts at a first load (JSON in on stdin,
the `Timings` out on stdout), importing no more than the kernels and MLX (the worker's modules
and mlx-lm's, ≈1 s, are not needed here).

The shapes come from the safetensors headers alone: one decoder layer's quantized matmuls and
the output head. Weights and inputs are random (speed does not depend on the values). A phase's
figure is a whole-model step estimate: layers × one layer's matmuls, plus the head for decode
(a prefill chunk projects only its last positions). The head is timed over at most
`HEAD_ROWS` of its outputs and scaled up (its time is linear in them), so a 128k vocabulary's
float32 head need not be materialised. Everything else a step does (attention, norms, RoPE)
runs the same kernels on both paths and is left out. A decode figure is the fastest of
`REPEATS` runs, after a warm-up in the first phase (the later ones run on the weights and
threads it warmed); the prefill chunk, which costs the most, the fastest of `PREFILL_REPEATS`,
timed over at most `PREFILL_ROWS` rows and scaled to the chunk: from 64 rows both paths are
compute-bound (the kernels dequantize a tile once per pass over all rows), so time grows with
the rows. The fastest run, not the median: other work on the machine only ever adds time (a
preempted thread delays whatever waits on it). For the same reason float32, timed after the
packed layouts, is not run again once a run took `GIVE_UP` times the slowest packed layout's
best at that phase: no repeat can make it the faster, and its runs were most of a first load (a
Llama-3.2-1B shape's float32 layer reads 250 MB a pass). Likewise the float layout on every
core, timed after the int8 dot products, against their best (a Llama-3.1-8B shape's float
layout took 3x their time from 32 rows: ≈0.6 s of repeats that could not change the choice);
the decision between the two is their geometric mean over the phases (models/cpu_path.py),
where a phase given up on counts one run, slower than a best of several only by noise.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import cast

import mlx.core as mx

from mlxd import kernels
from mlxd.models.cpu_path import Phases, Timings

Shape = tuple[int, int, int, int]  # out, in, group size, bits (as MLX stores them)
HEAD_ROWS = 8192
REPEATS = 3
PREFILL_REPEATS = 2
PREFILL_ROWS = 128
GIVE_UP = 2.0


@dataclass(frozen=True)
class ModelShapes:
    layer: tuple[Shape, ...]  # one decoder layer's quantized matmuls
    head: Shape | None  # the output projection (lm_head, or the tied embedding), if quantized
    layers: int

    @property
    def parameters(self) -> int:
        """The weights of these matmuls: the model's size as the kernels see it."""
        per_layer = sum(out * inputs for out, inputs, _, _ in self.layer)
        head = self.head[0] * self.head[1] if self.head else 0
        return self.layers * per_layer + head


@dataclass
class _Matrix:
    packed: kernels.Packed
    dot: kernels.Packed | None  # pack_dot's, where the kernels have integer dot products
    dense: mx.array | None  # float32 [out, in], where float32 is timed
    scale: float  # time multiplier (a head timed over a slice of its rows)

    @property
    def inputs(self) -> int:
        return int(self.packed.shape[1])


def _matrix(shape: Shape, precise: bool, float32: bool) -> _Matrix:
    out, in_dims, group, stored_bits = shape
    bits = kernels.KERNEL_BITS[stored_bits]  # the width it runs at (the values are arbitrary)
    rows = min(out, HEAD_ROWS)
    weight, scales, biases = _arbitrary_quantized(rows, in_dims, group, bits)
    dense = None
    if float32:
        dense = mx.dequantize(weight, scales, biases, group_size=group, bits=bits)
        mx.eval(dense)
    packed = kernels.pack(weight, scales, biases, group, bits)
    dot = None
    if kernels.integer_dot():
        dot = kernels.pack_dot(weight, scales, biases, group, bits, precise=precise)
    return _Matrix(packed, dot, dense, out / rows)


def _arbitrary_quantized(
    rows: int, in_dims: int, group: int, bits: int
) -> tuple[mx.array, mx.array, mx.array]:
    """Weights, scales and biases in MLX's affine layout with arbitrary values (the speed does
    not depend on them): a multiplicative hash of each word's index, where drawing normal
    weights and quantizing them took 2 of a Llama-3.2-1B shape's 2.6 s of setup."""
    words = mx.arange(rows * in_dims * bits // 32, dtype=mx.uint32)
    weight = (words * mx.array(2654435761, dtype=mx.uint32)).reshape(rows, -1)
    scales = ((mx.arange(rows * in_dims // group) % 7 + 1) * 0.002).astype(mx.float32)
    scales = scales.reshape(rows, -1)
    return weight, scales, -(2 ** (bits - 1)) * scales


def _best_ms(
    run: Callable[[], list[mx.array]], repeats: int, warm_up: bool, give_up_ms: float
) -> float:
    """The fastest of `repeats` runs, or of fewer once the fastest took over `give_up_ms`."""
    if warm_up:
        mx.eval(run())  # first-call allocations, thread pools
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        mx.eval(run())
        best = min(best, (time.perf_counter() - started) * 1e3)
        if best > give_up_ms:
            break
    return best


def _time(
    matrices: list[_Matrix],
    rows: int,
    packed: bool,
    prefill: bool = False,
    dot: bool = False,
    warm_up: bool = False,
    give_up_ms: float = math.inf,
) -> float:
    """ms for one pass of `matrices` over `rows` input rows (each scaled); packed: in the
    int8 dot products' layout with `dot`. Stops repeating past `give_up_ms` (the whole pass)."""
    total = 0.0
    scales = _by_scale(matrices)
    for scale, group in scales.items():
        inputs = {m.inputs: mx.random.normal((rows, m.inputs)) for m in group}
        mx.eval(list(inputs.values()))

        def run(group: list[_Matrix] = group, inputs: dict[int, mx.array] = inputs) -> list:
            x = inputs
            if packed:
                layouts = [m.dot if dot and m.dot else m.packed for m in group]
                return [kernels.qmatmul(x[p.shape[1]], p) for p in layouts]
            return [x[m.inputs] @ cast(mx.array, m.dense).T for m in group]

        repeats = PREFILL_REPEATS if prefill else REPEATS
        # The pass's bar shared evenly by its scale groups (one, in practice: a layer, a head).
        total += scale * _best_ms(run, repeats, warm_up, give_up_ms / scale / len(scales))
    return total


def _by_scale(matrices: list[_Matrix]) -> dict[float, list[_Matrix]]:
    groups: dict[float, list[_Matrix]] = {}
    for m in matrices:
        groups.setdefault(m.scale, []).append(m)
    return groups


def time_paths(
    shapes: ModelShapes, phases: Phases, precise: bool = True, float32: bool = True
) -> Timings:
    """Each phase's step estimate packed on every core, packed on one thread, float32, and
    packed as int8 dot products on every core (x as two int8 terms, or one unless `precise`),
    with the head's share of both packed layouts on every core (each part takes its faster).
    Without `float32` (it does not fit) only the packed layouts, on every core."""
    layer = [_matrix(s, precise, float32) for s in shapes.layer]
    head = [_matrix(shapes.head, precise, float32)] if shapes.head else []
    cores = len(os.sched_getaffinity(0))
    # Per part ("layer", "head") and phase: the slowest packed layout's best ms (float32 is
    # compared with each: on one thread under the mixed plan), float32's bar; and the int8 dot
    # products' (timed first), the float layout's bar on every core.
    packed_best: dict[tuple[str, int], float] = {}
    dot_best: dict[tuple[str, int], float] = {}

    def part(
        name: str, matrices: list[_Matrix], phase: int, packed: bool, dot: bool, shared: bool
    ) -> float:
        rows = phases.rows[phase]
        prefill = phase == len(phases.rows) - 1
        timed = min(rows, PREFILL_ROWS) if prefill else rows
        key = (name, phase)
        if not packed:
            give_up = GIVE_UP * packed_best.get(key, math.inf)
        elif not dot and shared:
            give_up = GIVE_UP * dot_best.get(key, math.inf)
        else:
            give_up = math.inf
        ms = _time(matrices, timed, packed, prefill, dot, warm_up=phase == 0, give_up_ms=give_up)
        if packed:
            packed_best[key] = max(ms, packed_best.get(key, 0.0))
        if dot:
            dot_best[key] = ms
        return ms * rows / timed

    def phase_times(
        packed: bool, dot: bool = False, shared: bool = True
    ) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per phase the step estimate, and the head's share of it."""
        steps, heads = [], []
        for phase in range(len(phases.rows)):
            ms = shapes.layers * part("layer", layer, phase, packed, dot, shared)
            head_ms = 0.0
            if head and phase < len(phases.decode):  # a prefill chunk projects its last rows
                head_ms = part("head", head, phase, packed, dot, shared)
            steps.append(ms + head_ms)
            heads.append(head_ms)
        return tuple(steps), tuple(heads)

    kernels.share_cores(True)  # every core, unless a float32 model in this process forbids it
    packed_dot, head_dot = phase_times(True, dot=True) if kernels.integer_dot() else ((), ())
    packed_all, head_packed = phase_times(True)
    if not float32:
        return Timings(packed_all, packed_all, (), packed_dot, head_packed, head_dot)
    kernels.set_threads(1)
    packed_one = phase_times(True, shared=False)[0] if cores > 1 else packed_all
    return Timings(packed_all, packed_one, phase_times(False)[0], packed_dot, head_packed, head_dot)


def main() -> None:
    """`time_paths` of the arguments read from stdin as JSON: {"shapes": ModelShapes as a
    dict, "phases": Phases as a dict, "precise", "float32"}; the Timings as JSON on stdout."""
    args = json.load(sys.stdin)
    raw = args["shapes"]
    shapes = ModelShapes(
        tuple(tuple(s) for s in raw["layer"]),
        tuple(raw["head"]) if raw["head"] else None,
        raw["layers"],
    )
    phases = Phases(args["phases"]["prefill"], tuple(args["phases"]["decode"]))
    timings = time_paths(shapes, phases, args["precise"], args["float32"])
    print(json.dumps(asdict(timings)))


if __name__ == "__main__":
    main()
