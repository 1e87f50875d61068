"""Time a quantized model's matmuls packed (mlxd's kernels) and float32 (BLAS) at its own
shapes: the child process models/cpu_path_timing.py starts at a first load (JSON in on stdin,
the `Timings` out on stdout), importing no more than the kernels and MLX (the worker's modules
and mlx-lm's, ≈1 s, are not needed here).

The shapes come from the safetensors headers alone: one decoder layer's quantized matmuls and
the output head. Weights and inputs are random (speed does not depend on the values). A
mixture of experts' stacks run the model's gather, each of a phase's rows routed to its top k
experts drawn uniformly: at a decode step an expert gets a few rows, not all of them (timed
as one dense matrix of every expert, a Qwen3-30B-A3B shape's one-row step came out 6–12x its
gather's figure, 128 experts and top 8), and a layer with experts is timed over the whole
prefill chunk (an expert's rows are its share of the chunk's). A stack over `STACK_BYTES` is
timed over a slice of its experts that keeps each one's share of the routes, its time scaled up
to the whole stack. A phase's
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
packed layouts, is not run again once the faster of two runs took `GIVE_UP` times the slowest
packed layout's best at that phase (one run alone may be a stall): no repeat can make it the
faster, and its runs were most of a first load (a Llama-3.2-1B shape's float32 layer reads
250 MB a pass). The two packed layouts on every core (int8 dot products, float) are timed in
turn, a run of one then a run of the other: timed one after the other, a slow spell of the VM
fell on one alone, and SmolLM2's layouts on the AVX2 stand-in swapped places from one load to
the next (the int8 dot products' figures 2.1–2.5x apart over six timings, the float layout's
1.2–1.3x). Each gives up at `GIVE_UP` times the
other's best (a Llama-3.1-8B shape's float layout took 3x their time from 32 rows: ≈0.6 s of
repeats that could not change the choice); the decision between the two is their geometric
mean over the phases (models/cpu_path.py), where a phase given up on counts two runs, slower
than a best of several only by noise.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Literal, cast

import mlx.core as mx

from mlxd import kernels
from mlxd.models.cpu_path import Phases, Timings

Shape = tuple[int, int, int, int]  # out, in, group size, bits (as MLX stores them)
Experts = tuple[int, int, int, int, int]  # a stack of experts: how many, then each one's Shape
Layout = Literal["dot", "float", "float32"]  # packed as int8 dot products, packed, BLAS
HEAD_ROWS = 8192
REPEATS = 3
PREFILL_REPEATS = 3
PREFILL_ROWS = 128
# Packed bytes of a stack of experts timed whole. A DeepSeek-V3 layer's three stacks of 256
# experts are 5.6 GB at 4 bits (twice that with the int8 layout's copy), which this child would
# hold before the model loads; a slice of 32 of them takes each expert's share of the routes
# as the whole stack does, so its time scaled by 256 / 32 is the stack's.
STACK_BYTES = 256 * 2**20
GIVE_UP = 2.0


@dataclass(frozen=True)
class ModelShapes:
    layer: tuple[Shape, ...]  # one decoder layer's quantized matmuls
    head: Shape | None  # the output projection (lm_head, or the tied embedding), if quantized
    layers: int
    experts: tuple[Experts, ...] = ()  # one decoder layer's stacks of experts
    experts_per_token: int = 0  # their top k (0: unknown, then every expert)
    # `layer` as the float32 plan runs it, where the packed one fuses matmuls (q, k and v
    # apart: models/fused.py fuses packed layers only); () where the same.
    apart: tuple[Shape, ...] = ()

    @property
    def parameters(self) -> int:
        """The weights of these matmuls: the model's size as the kernels see it."""
        dense = sum(out * inputs for out, inputs, _, _ in self.layer)
        stacks = sum(count * out * inputs for count, out, inputs, _, _ in self.experts)
        head = self.head[0] * self.head[1] if self.head else 0
        return self.layers * (dense + stacks) + head


@dataclass
class _Matrix:
    packed: kernels.Packed
    dot: kernels.Packed | None  # pack_dot's, where the kernels have integer dot products
    dense: mx.array | None  # float32 [out, in], where float32 is timed (never for experts)
    scale: float  # time multiplier (a head timed over a slice of its rows, a stack of its experts)
    per_token: int = 0  # a stack of experts: each row of x routed to this many of them

    @property
    def inputs(self) -> int:
        return int(self.packed.shape[-1])


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


def _stack(experts: Experts, per_token: int, precise: bool) -> _Matrix:
    """A stack of experts as the loader packs it: no float32 copy under any plan
    (models/packed.py), so a "float32" pass runs it packed too. Over `STACK_BYTES`, a slice
    of it (`_slice`)."""
    count, out, in_dims, group, stored_bits = experts
    bits = kernels.KERNEL_BITS[stored_bits]
    timed, routes, scale = _slice(count, min(per_token or count, count), out * in_dims * bits // 8)
    weight, scales, biases = (
        a.reshape(timed, out, -1) for a in _arbitrary_quantized(timed * out, in_dims, group, bits)
    )
    packed = kernels.pack_experts(weight, scales, biases, group, bits)
    dot = None
    if kernels.integer_dot():
        dot = kernels.pack_experts(weight, scales, biases, group, bits, dot=True, precise=precise)
    return _Matrix(packed, dot, None, scale, routes)


def _slice(count: int, per_token: int, expert_bytes: int) -> tuple[int, int, float]:
    """How many of a stack's `count` experts to time, the top k to route each row to among
    them, and the time's multiplier: the whole stack where it packs within `STACK_BYTES`;
    else the most experts that do in a multiple of the fewest E' with a whole k' = k E' / E
    (each expert's share of the routes, k / E, is then the stack's), times E / E'. Where even
    that is too large (top 1 of a few large experts: Llama 4's), each row keeps its k experts
    among fewer: a row's work, and so a decode step's, is the stack's, while an expert gets
    more rows than it would (a prefill chunk's estimate is then low)."""
    if count * expert_bytes <= STACK_BYTES:
        return count, per_token, 1.0
    unit = count // math.gcd(count, per_token)
    if unit * expert_bytes <= STACK_BYTES:
        timed = STACK_BYTES // (expert_bytes * unit) * unit
        return timed, per_token * timed // count, count / timed
    return max(per_token, STACK_BYTES // expert_bytes), per_token, 1.0


def _routes(rows: int, experts: int, per_token: int) -> mx.array:
    """Each of `rows` tokens routed to `per_token` distinct experts, uniformly (a fixed draw:
    the same routes for every layout)."""
    draw = mx.random.uniform(shape=(rows, experts), key=mx.random.key(rows))
    return mx.argsort(draw, axis=-1)[:, :per_token].astype(mx.uint32)


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
    runs: Sequence[Callable[[], list[mx.array]]], repeats: int, warm_up: bool, give_up_ms: float
) -> list[float]:
    """The fastest of `repeats` runs of each of `runs`, taken in turn: a slow spell of the
    machine then falls on each alike, not on whichever went first. A run stops repeating once
    the fastest of two took over `give_up_ms`, or `GIVE_UP` times another's fastest: one run
    alone can be a stall (an 8-row pass of SmolLM2's layer once took 166 ms, 14 ms at best)."""
    if warm_up:
        for run in runs:
            mx.eval(run())  # first-call allocations, thread pools
    best = [math.inf] * len(runs)
    for repeat in range(repeats):
        for i, run in enumerate(runs):
            others = min((b for j, b in enumerate(best) if j != i), default=math.inf)
            if repeat >= 2 and best[i] > min(give_up_ms, GIVE_UP * others):
                continue
            started = time.perf_counter()
            mx.eval(run())
            best[i] = min(best[i], (time.perf_counter() - started) * 1e3)
    return best


def _pass(
    group: list[_Matrix], inputs: dict[int, mx.array], layout: Layout
) -> Callable[[], list[mx.array]]:
    """One pass of `group`'s matmuls over `inputs` (by input width) in `layout`; a stack of
    experts as the model's gather runs it, each row of x through its routed experts."""
    rows = next(iter(inputs.values())).shape[0]
    calls: list[Callable[[], mx.array]] = []
    for m in group:
        x, packed = inputs[m.inputs], m.dot if layout == "dot" and m.dot else m.packed
        if m.per_token:
            routes = _routes(rows, int(packed.weight.shape[0]), m.per_token)
            mx.eval(routes)
            calls.append(partial(kernels.gather_qmatmul, x, routes, packed))
        elif layout == "float32":
            calls.append(partial(mx.matmul, x, cast(mx.array, m.dense).T))
        else:
            calls.append(partial(kernels.qmatmul, x, packed))
    return lambda: [call() for call in calls]


def _time(
    matrices: list[_Matrix],
    rows: int,
    layouts: Sequence[Layout],
    prefill: bool = False,
    warm_up: bool = False,
    give_up_ms: float = math.inf,
) -> list[float]:
    """ms for one pass of `matrices` over `rows` input rows (each scaled) in each of
    `layouts`, timed in turn. Stops repeating past `give_up_ms` (the whole pass)."""
    totals = [0.0] * len(layouts)
    scales = _by_scale(matrices)
    for scale, group in scales.items():
        inputs = {m.inputs: mx.random.normal((rows, m.inputs)) for m in group}
        mx.eval(list(inputs.values()))
        runs = [_pass(group, inputs, layout) for layout in layouts]
        repeats = PREFILL_REPEATS if prefill else REPEATS
        # The pass's bar shared evenly by its scale groups (a layer or a head; a sliced stack
        # of experts apart).
        best = _best_ms(runs, repeats, warm_up, give_up_ms / scale / len(scales))
        totals = [total + scale * ms for total, ms in zip(totals, best, strict=True)]
    return totals


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
    made: dict[tuple[Shape, int], _Matrix] = {}

    def matrices(listed: tuple[Shape, ...], dense: bool) -> list[_Matrix]:
        """A matrix per shape of `listed`, each repeat of a shape its own (gate and up are two
        matrices in the model, not one read twice), made once for both layers below."""
        seen: Counter[Shape] = Counter()
        result = []
        for shape in listed:
            key = (shape, seen[shape])
            seen[shape] += 1
            if key not in made:
                made[key] = _matrix(shape, precise, dense)
            result.append(made[key])
        return result

    stacks = [_stack(e, shapes.experts_per_token, precise) for e in shapes.experts]
    # The float32 plan's layer, where the packed one fuses some of its matmuls (q, k and v):
    # the rest are the same matrices, with their float32 copies.
    apart = matrices(shapes.apart, float32) + stacks if shapes.apart else None
    layer = matrices(shapes.layer, float32 and not shapes.apart) + stacks
    apart = apart or layer
    head = [_matrix(shapes.head, precise, float32)] if shapes.head else []
    cores = len(os.sched_getaffinity(0))
    # Per part ("layer", "head") and phase: the slowest packed layout's best ms (float32 is
    # compared with each: on one thread under the mixed plan), float32's bar. The packed
    # layouts on every core are each other's bar (`_best_ms`).
    packed_best: dict[tuple[str, int], float] = {}
    packed_layouts: list[Layout] = ["dot", "float"] if kernels.integer_dot() else ["float"]

    def part(name: str, matrices: list[_Matrix], phase: int, layouts: list[Layout]) -> list[float]:
        rows = phases.rows[phase]
        prefill = phase == len(phases.rows) - 1
        # A stack of experts takes the whole chunk: each expert's share of it is its rows.
        whole = not prefill or any(m.per_token for m in matrices)
        timed = rows if whole else min(rows, PREFILL_ROWS)
        key = (name, phase)
        float32 = layouts == ["float32"]
        give_up = GIVE_UP * packed_best.get(key, math.inf) if float32 else math.inf
        ms = _time(matrices, timed, layouts, prefill, warm_up=phase == 0, give_up_ms=give_up)
        if not float32:
            packed_best[key] = max(*ms, packed_best.get(key, 0.0))
        return [m * rows / timed for m in ms]

    def phase_times(
        layouts: list[Layout], matrices: list[_Matrix] = layer
    ) -> list[tuple[tuple[float, ...], tuple[float, ...]]]:
        """Per layout, per phase the step estimate (a layer of `matrices`), and the head's
        share of it."""
        steps: list[list[float]] = [[] for _ in layouts]
        heads: list[list[float]] = [[] for _ in layouts]
        for phase in range(len(phases.rows)):
            ms = part("layer", matrices, phase, layouts)
            head_ms = [0.0] * len(layouts)
            if head and phase < len(phases.decode):  # a prefill chunk projects its last rows
                head_ms = part("head", head, phase, layouts)
            for i in range(len(layouts)):
                steps[i].append(shapes.layers * ms[i] + head_ms[i])
                heads[i].append(head_ms[i])
        return [(tuple(s), tuple(h)) for s, h in zip(steps, heads, strict=True)]

    kernels.share_cores(True)  # every core, unless a float32 model in this process forbids it
    kernels.set_dot_buffer_rows(0)  # the int8 layout as int8 dot products at every row count
    *dot, (packed_all, head_packed) = phase_times(packed_layouts)
    packed_dot, head_dot = dot[0] if dot else ((), ())
    if not float32:
        return Timings(packed_all, packed_all, (), packed_dot, head_packed, head_dot)
    # Float32 last, against the packed layouts' figures.
    kernels.set_threads(1)
    packed_one = phase_times(["float"])[0][0] if cores > 1 else packed_all
    float32_ms = phase_times(["float32"], apart)[0][0]
    return Timings(packed_all, packed_one, float32_ms, packed_dot, head_packed, head_dot)


def main() -> None:
    """`time_paths` of the arguments read from stdin as JSON: {"shapes": ModelShapes as a
    dict, "phases": Phases as a dict, "precise", "float32"}; the Timings as JSON on stdout."""
    args = json.load(sys.stdin)
    raw = args["shapes"]
    shapes = ModelShapes(
        tuple(tuple(s) for s in raw["layer"]),
        tuple(raw["head"]) if raw["head"] else None,
        raw["layers"],
        tuple(tuple(e) for e in raw["experts"]),
        raw["experts_per_token"],
        tuple(tuple(s) for s in raw["apart"]),
    )
    phases = Phases(args["phases"]["prefill"], tuple(args["phases"]["decode"]))
    timings = time_paths(shapes, phases, args["precise"], args["float32"])
    print(json.dumps(asdict(timings)))


if __name__ == "__main__":
    main()
