"""Time a quantized model's matmuls packed (mlxd's kernels) and float32 (BLAS) at its own
shapes, for models/cpu_path.py to decide between them.

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
Llama-3.2-1B shape's float32 layer reads 250 MB a pass). Timings taken while other work held
every core (`machine_busy`) are used for this load but not cached: the next load times again
(measured: a cache written at load average 18 kept SmolLM2 on one thread, 49 tok/s at one
stream on the quiet machine, against 77 for the choice it times there).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import math
import os
import platform
import re
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from mlxd import kernels
from mlxd.accel import backend_name
from mlxd.config import ModelConfig, ServerConfig
from mlxd.models.cpu_path import Choice, Phases, TimingCache, Timings, decide
from mlxd.models.estimate import estimate_weight_bytes, packed_weight_bytes, quantized_shapes
from mlxd.models.packability import why_not_packable
from mlxd.models.packed import pack

Shape = tuple[int, int, int, int]  # out, in, group size, bits
HEAD_ROWS = 8192
REPEATS = 3
PREFILL_REPEATS = 2
PREFILL_ROWS = 128
GIVE_UP = 2.0
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class ModelShapes:
    layer: tuple[Shape, ...]  # one decoder layer's quantized matmuls
    head: Shape | None  # the output projection (lm_head, or the tied embedding), if quantized
    layers: int


def model_shapes(model_dir: Path) -> ModelShapes | None:
    """The model's packable matmul shapes, or None when its headers show no such decoder layer
    (the layers the kernels do not take run float32 on both paths: nothing to compare)."""
    modules = {
        name: shape
        for name, shape in quantized_shapes(model_dir).items()
        if why_not_packable(shape[0], shape[2], shape[3]) is None
    }
    layer_of = {name: m.group(1) for name in modules if (m := _LAYER.search(name))}
    if not layer_of:
        return None
    first = min(layer_of.values(), key=int)
    layer = tuple(modules[name] for name in sorted(layer_of) if layer_of[name] == first)
    heads = [name for name in modules if name.endswith("lm_head")]
    if not heads:  # tied: the embedding table is the head (when no float lm_head exists)
        heads = [name for name in modules if name.endswith("embed_tokens")]
    head = modules[heads[0]] if heads else None
    return ModelShapes(layer, head, len(set(layer_of.values())))


def identity(
    shapes: ModelShapes, phases: Phases, precise: bool = True, float32: bool = True
) -> dict[str, Any]:
    """What the timings depend on (the cache key's ingredients): with the arguments of
    `time_paths`."""
    spec = importlib.util.find_spec("mlxd.kernels._cpu")
    origin = spec.origin if spec is not None else None
    build = hashlib.sha256(Path(origin).read_bytes()).hexdigest()[:16] if origin else None
    return {
        "cpu": cpu_model(),
        "kernels": build,
        "isa": kernels.isa(),  # the variant the kernels dispatched to (or were forced to)
        "blas": [os.environ.get(k) for k in ("LD_PRELOAD", "OPENBLAS_CORETYPE")],
        "threads": len(os.sched_getaffinity(0)),
        "mlx": importlib.metadata.version("mlx"),
        "shapes": [list(shapes.layer), shapes.head, shapes.layers],
        "phases": list(phases.rows),
        "precise": precise,
        "float32": float32,
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() in ("model name", "Model", "CPU part"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
    out, in_dims, group, bits = shape
    rows = min(out, HEAD_ROWS)
    weight, scales, biases = _arbitrary_quantized(rows, in_dims, group, bits)
    dense = None
    if float32:
        dense = mx.dequantize(weight, scales, biases, group_size=group, bits=bits)
        mx.eval(dense)
    packed = pack(weight, scales, biases, group, bits)
    dot = None
    if kernels.integer_dot():
        dot = pack(weight, scales, biases, group, bits, dot=True, precise=precise)
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
    """`time_paths_here` in a child process. Timed in the worker itself, the kernels would
    start an OpenMP thread pool on the timing thread beside the one the model thread starts:
    with more OpenMP threads than cores libgomp makes every pool sleep between kernels, and
    a SmolLM2 stream ran at 55 tokens/s instead of 120 for the rest of the worker's life."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as child:
        return child.submit(time_paths_here, shapes, phases, precise, float32).result()


def time_paths_here(
    shapes: ModelShapes, phases: Phases, precise: bool = True, float32: bool = True
) -> Timings:
    """Each phase's step estimate packed on every core, packed on one thread, float32, and
    packed as int8 dot products on every core (x as two int8 terms, or one unless `precise`).
    Without `float32` (it does not fit) only the packed layouts, on every core."""
    layer = [_matrix(s, precise, float32) for s in shapes.layer]
    head = [_matrix(shapes.head, precise, float32)] if shapes.head else []
    cores = len(os.sched_getaffinity(0))
    # Per part ("layer", "head") and phase: the slowest packed layout's best ms (float32 is
    # compared with each: on one thread under the mixed plan), float32's bar.
    packed_best: dict[tuple[str, int], float] = {}

    def part(name: str, matrices: list[_Matrix], phase: int, packed: bool, dot: bool) -> float:
        rows = phases.rows[phase]
        prefill = phase == len(phases.rows) - 1
        timed = min(rows, PREFILL_ROWS) if prefill else rows
        key = (name, phase)
        give_up = math.inf if packed else GIVE_UP * packed_best.get(key, math.inf)
        ms = _time(matrices, timed, packed, prefill, dot, warm_up=phase == 0, give_up_ms=give_up)
        if packed:
            packed_best[key] = max(ms, packed_best.get(key, 0.0))
        return ms * rows / timed

    def phase_times(packed: bool, dot: bool = False) -> tuple[float, ...]:
        steps = []
        for phase in range(len(phases.rows)):
            ms = shapes.layers * part("layer", layer, phase, packed, dot)
            if head and phase < len(phases.decode):  # a prefill chunk projects its last rows
                ms += part("head", head, phase, packed, dot)
            steps.append(ms)
        return tuple(steps)

    kernels.share_cores(True)  # every core, unless a float32 model in this process forbids it
    packed_all = phase_times(True)
    packed_dot = phase_times(True, dot=True) if kernels.integer_dot() else ()
    if not float32:
        return Timings(packed_all, packed_all, (), packed_dot)
    kernels.set_threads(1)
    packed_one = phase_times(True) if cores > 1 else packed_all
    return Timings(packed_all, packed_one, phase_times(False), packed_dot)


def machine_busy() -> bool:
    """Other work holding every core now: timings taken now would say more about it than about
    the paths. Read from the kernel's count of runnable tasks where there is one; else from the
    one-minute load average (twice the cores), which lags: right after a heavy job (a benchmark,
    another model's load) it calls an idle machine busy, and the next load times again."""
    cores = len(os.sched_getaffinity(0))
    running = runnable_tasks()
    if running is None:
        return os.getloadavg()[0] > 2 * cores
    return running - 1 >= cores  # this thread is one of them


def runnable_tasks(samples: int = 5, interval_s: float = 0.01) -> int | None:
    """The machine's runnable tasks now (Linux's /proc/stat procs_running, the middle of a few
    samples: one can catch a moment's spike), or None where the kernel does not say."""
    counts = []
    for i in range(samples):
        if i:
            time.sleep(interval_s)
        try:
            stat = Path("/proc/stat").read_text()
        except OSError:
            return None
        found = re.search(r"^procs_running (\d+)$", stat, re.MULTILINE)
        if found is None:
            return None
        counts.append(int(found.group(1)))
    return sorted(counts)[len(counts) // 2]


# This process's timings by key, whether they came from the disk cache and whether they are
# kept in it (not when timed on a busy machine): a worker decides when it locates the model,
# then again (the same way) when it loads it.
_timed: dict[str, tuple[Timings, bool, bool]] = {}


def choose_cpu_path(model_dir: Path, config: ModelConfig, server: ServerConfig) -> Choice | None:
    """The CPU path for a quantized LLM loaded with dtype auto, or None where there is no
    choice (another backend or dtype, kernels not built, weights the kernels do not take, a
    distributed rank). Times the paths unless this CPU, kernel build, shape set and
    `cpu_activations` were timed before (the cache under server.cache_dir)."""
    if not (
        backend_name() == "cpu"
        and config.kind == "llm"
        and config.dtype == "auto"
        and config.distributed is None
        and kernels.available()
    ):
        return None
    packed_bytes = packed_weight_bytes(model_dir)
    shapes = model_shapes(model_dir)
    if packed_bytes is None or shapes is None:
        return None
    phases = Phases(prefill=config.batch.prefill_step_size)
    float32_bytes = estimate_weight_bytes(model_dir, "float32")
    budget = server.budget_bytes  # unset: the default share of physical memory

    def decided(timings: Timings | None, cached: bool = False) -> Choice:
        return decide(
            phases,
            timings,
            packed_bytes=packed_bytes,
            float32_bytes=float32_bytes,
            kv_bytes=config.cache.ram,
            budget=budget,
            cached=cached,
            precise=precise,
        )

    precise = config.cpu_activations == "precise"
    float32 = float32_bytes + config.cache.ram <= budget
    # Packed is then the only plan; with x as one int8 term the two packed layouts are timed
    # (with two, the float layout runs: the same bytes, and no timing lengthens the load).
    if not float32 and (precise or not kernels.integer_dot()):
        return decided(None)
    ident = identity(shapes, phases, precise, float32)
    cache, key = TimingCache(server.cache_dir), TimingCache.key(ident)
    if key not in _timed:
        timings = cache.get(key)
        busy = timings is None and machine_busy()  # before our own timing adds to the load
        timed = timings or time_paths(shapes, phases, precise, float32)
        _timed[key] = (timed, timings is not None, not busy)
        if timings is None and not busy:
            cache.put(key, ident, _timed[key][0])
    timings, cached, kept = _timed[key]
    return dataclasses.replace(decided(timings, cached), kept=kept)
