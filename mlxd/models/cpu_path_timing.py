"""Choose a quantized model's CPU path at load: its shapes from the safetensors headers, the
timings from the cache or a child process (models/cpu_path_probe.py, which says how it times),
the decision by models/cpu_path.py. Timings taken while other work held every core
(`machine_busy`) are used for this load but not cached: the next load times again (measured:
a cache written at load average 18 kept SmolLM2 on one thread, 49 tok/s at one stream on the
quiet machine, against 77 for the choice it times there). Nor are those taken while the
machine's pace moved, and cached ones taken at a slower pace than now are timed again
(models/cpu_path_cache.py: a noisy neighbour shows in neither count of tasks).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxd import kernels
from mlxd.accel import backend_name
from mlxd.config import ModelConfig, ServerConfig
from mlxd.kernels import KERNEL_BITS
from mlxd.models.cpu_path import Choice, Phases, Timings, decide, precise_activations
from mlxd.models.cpu_path_cache import UNSTEADY, TimingCache, pace_ms
from mlxd.models.cpu_path_probe import Experts, ModelShapes, Shape
from mlxd.models.estimate import (
    Headers,
    estimate_weight_bytes,
    headers,
    packed_weight_bytes,
    quantized_shapes,
)
from mlxd.models.groups import members_of
from mlxd.models.kernel_layers import kernel_fusions
from mlxd.models.packability import has_own_head, is_lm_head, why_not_packable

log = logging.getLogger(__name__)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def model_shapes(source: Path | Headers) -> ModelShapes | None:
    """The model's packable matmul shapes (of a model directory, or headers already read), or
    None when its headers show no such decoder layer (the layers the kernels do not take run
    float32 on both paths: nothing to compare). The layer timed is the most common one: a
    mixture of experts with a few dense layers first (DeepSeek's `first_k_dense_replace`,
    Qwen3-MoE's `mlp_only_layers`) is timed as its expert layers; q, k and v, and gate and up,
    as one matmul each where the model runs them so (`_fused`)."""
    read = headers(source)
    modules: dict[str, Shape] = {}
    stacks: dict[str, int] = {}  # experts per stack [E, out, in], whose shape counts E x out rows
    for name, (rows, inputs, group, bits) in quantized_shapes(read).items():
        stored = read.tensors[f"{name}.weight"]["shape"]
        count = stored[0] if len(stored) == 3 else 1
        if why_not_packable(rows // count, group, bits) is None:
            modules[name] = (rows // count, inputs, group, bits)
            if len(stored) == 3:
                stacks[name] = count
    layers: dict[int, dict[str, str]] = {}  # by index, each matmul's full name by its own
    for name in modules:
        if found := _LAYER.search(name):
            layers.setdefault(int(found.group(1)), {})[name[found.end() :]] = name
    if not layers:
        return None
    kinds = Counter(
        tuple((part, modules[name], stacks.get(name, 1)) for part, name in sorted(parts.items()))
        for _, parts in sorted(layers.items())
    )
    kind = kinds.most_common(1)[0][0]  # the first layer of that kind on ties
    fused = _fused(kind, kernel_fusions(read.config))
    dense = [shape for _, shape, count in fused if count == 1]
    experts: list[Experts] = [(count, *shape) for _, shape, count in fused if count > 1]
    apart = [shape for _, shape, count in kind if count == 1] if fused != kind else []
    heads = [name for name in modules if is_lm_head(name)]
    if not has_own_head(name.rpartition(".")[0] for name in read.tensors):
        # Tied: the embedding table is the head (untied beside a float lm_head: none packed).
        heads = [name for name in modules if name.endswith("embed_tokens")]
    head = modules[heads[0]] if heads else None
    per_token = (read.experts_per_token or 0) if experts else 0
    return ModelShapes(tuple(dense), head, len(layers), tuple(experts), per_token, tuple(apart))


Part = tuple[str, Shape, int]  # a layer's matmul: its name in the layer, shape, experts


def _fused(layer: tuple[Part, ...], fusions: frozenset[str]) -> tuple[Part, ...]:
    """`layer` as the kernels' path runs it: each of `fusions` (`KernelAttention`'s q, k and v,
    `RationalSwiGLU`'s gate and up) of one layout as one matmul over their rows together
    (models/fused.py; the float32 plan's dense layers run them apart, `ModelShapes.apart`).
    Timed apart, q, k and v cost two kernel calls a layer more than the model's step (and on
    the int8 layout two more roundings of x), and SmolLM2's k and v, 192 rows each, were jobs
    too short for two threads to share."""
    parts = {name: (shape, count) for name, shape, count in layer}
    for name in list(parts):
        named = members_of(name)
        if named is None or named[0].rpartition(".")[2] not in fusions or name != named[1][0]:
            continue  # fused by its group's first member
        fused, names = named
        found = [parts.get(n) for n in names]
        if any(f is None or f[1] != 1 for f in found):
            continue  # not all there, or stacks of experts
        shapes = [f[0] for f in found if f is not None]
        # As the kernels hold them (a Q5_K_M's Q5_K q and k and Q6_K v all at 8 bits).
        layouts = {(inputs, group, KERNEL_BITS[bits]) for _, inputs, group, bits in shapes}
        if len(layouts) != 1:
            continue  # inputs, group or width differ: the loader keeps them apart too
        for n in names:
            del parts[n]
        rows = sum(shape[0] for shape in shapes)
        parts[fused] = ((rows, *layouts.pop()), 1)
    return tuple(sorted((name, shape, count) for name, (shape, count) in parts.items()))


def identity(
    shapes: ModelShapes, phases: Phases, precise: bool = True, float32: bool = True
) -> dict[str, Any]:
    """What the timings depend on (the cache key's ingredients): with the arguments of
    `time_paths`, and the probe's own code with the kernels' Python side (a change to how it
    times or calls them, the shapes and the kernel build unchanged, times again rather than
    keep figures it would no longer take)."""
    return {
        "cpu": cpu_model(),
        "kernels": source_hash("mlxd.kernels._cpu"),
        "probe": source_hash("mlxd.models.cpu_path_probe", "mlxd.kernels", "mlxd.kernels.layout"),
        "isa": kernels.isa(),  # the variant the kernels dispatched to (or were forced to)
        "blas": [os.environ.get(k) for k in ("LD_PRELOAD", "OPENBLAS_CORETYPE")],
        "threads": len(os.sched_getaffinity(0)),
        "mlx": importlib.metadata.version("mlx"),
        # (a mixture of experts' stacks and top k, and the float32 plan's separate matmuls,
        # only where there are some)
        "shapes": [list(shapes.layer), shapes.head, shapes.layers]
        + ([list(shapes.experts), shapes.experts_per_token] if shapes.experts else [])
        + ([list(shapes.apart)] if shapes.apart else []),
        "phases": list(phases.rows),
        "precise": precise,
        "float32": float32,
    }


def source_hash(*modules: str) -> str | None:
    """The first 16 hex digits of the SHA-256 of the `modules`' files (None: one is not
    there, such as kernels never built)."""
    digest = hashlib.sha256()
    for module in modules:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            return None
        digest.update(Path(spec.origin).read_bytes())
    return digest.hexdigest()[:16]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() in ("model name", "Model", "CPU part"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def time_paths(
    shapes: ModelShapes, phases: Phases, precise: bool = True, float32: bool = True
) -> Timings:
    """models/cpu_path_probe.py's `time_paths` in a child process. Timed in the worker itself,
    the kernels would start an OpenMP thread pool on the timing thread beside the one the
    model thread starts: with more OpenMP threads than cores libgomp makes every pool sleep
    between kernels, and a SmolLM2 stream ran at 55 tokens/s instead of 120 for the rest of
    the worker's life. A process of its own, not multiprocessing's: a spawned child imports
    its parent's main module, the worker's (≈1 s of the first load)."""
    request = {
        "shapes": dataclasses.asdict(shapes),
        "phases": dataclasses.asdict(phases),
        "precise": precise,
        "float32": float32,
    }
    child = subprocess.run(
        [sys.executable, "-m", "mlxd.models.cpu_path_probe"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        check=False,
    )
    if child.returncode != 0:
        log.warning("the CPU path timing's child failed:\n%s", child.stderr.strip())
        lines = child.stderr.strip().splitlines() or ["no message"]
        raise RuntimeError(f"timing the CPU paths failed (exit {child.returncode}): {lines[-1]}")
    return Timings.from_json(json.loads(child.stdout.strip().splitlines()[-1]))  # its last line


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


@dataclasses.dataclass(frozen=True)
class Timed:
    """A load's timings and how it came by them."""

    timings: Timings
    cached: bool  # read from the cache
    kept: bool  # in the cache for the next load
    note: str = ""  # what it saw of the machine (Choice.timing_note)


def timed_or_cached(
    cache: TimingCache, key: str, identity: dict[str, Any], time: Callable[[], Timings]
) -> Timed:
    """The cache's timings under `key` unless they were taken at a slower pace than now; else
    `time()`'s, kept under `key` unless the machine was busy or its pace moved meanwhile."""
    record = cache.get(key)
    before = pace_ms()
    note = ""
    if record is not None:
        if record.pace_ms is None or record.pace_ms < UNSTEADY * before:
            return Timed(record.timings, cached=True, kept=True)
        note = f"timed again: the cached timings were taken at {record.pace_ms / before:.1f}x "
        note += "this load's pace"
    busy = machine_busy()  # before our own timing adds to the load
    timings = time()
    after = pace_ms()
    moved = max(before, after) / min(before, after)
    why_not = ""
    if busy:
        why_not = "timed on a busy machine, not cached"
    elif moved > UNSTEADY:
        why_not = f"the machine's pace moved {moved:.1f}x while timing, not cached"
    else:
        cache.put(key, identity, timings, (before + after) / 2)
    return Timed(
        timings, cached=False, kept=not why_not, note="; ".join(filter(None, (note, why_not)))
    )


# This process's timings by key: a worker decides when it locates the model, then again (the
# same way) when it loads it.
_timed: dict[str, Timed] = {}


def choose_cpu_path(
    weights: Path | Headers, config: ModelConfig, server: ServerConfig
) -> Choice | None:
    """The CPU path for a quantized LLM loaded with dtype auto (its model directory, or a
    GGUF's headers as its conversion will write them), or None where there is no choice
    (another backend or dtype, kernels not built, weights the kernels do not take, a
    distributed rank). Times the paths unless this CPU, kernel build, probe, shape set and
    `cpu_activations` were timed before (the cache under server.cache_dir)."""
    if not (
        backend_name() == "cpu"
        and config.kind == "llm"
        and config.dtype == "auto"
        and config.distributed is None
        and kernels.available()
    ):
        return None
    read = headers(weights)
    packed_bytes = packed_weight_bytes(read)
    shapes = model_shapes(read)
    if packed_bytes is None or shapes is None:
        return None
    phases = Phases(prefill=config.batch.prefill_step_size)
    float32_bytes = estimate_weight_bytes(read, "float32")
    budget = server.budget_bytes  # unset: the default share of memory (host_memory.py)

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

    precise = precise_activations(config.cpu_activations, shapes.parameters)
    float32 = float32_bytes + config.cache.ram <= budget
    # Packed is then the only plan; with x as one int8 term the two packed layouts are timed
    # (with two, the float layout runs: the same bytes, and no timing lengthens the load).
    if not float32 and (precise or not kernels.integer_dot()):
        return decided(None)
    ident = identity(shapes, phases, precise, float32)
    cache, key = TimingCache(server.cache_dir), TimingCache.key(ident)
    if key not in _timed:
        _timed[key] = timed_or_cached(
            cache, key, ident, lambda: time_paths(shapes, phases, precise, float32)
        )
    timed = _timed[key]
    return dataclasses.replace(
        decided(timed.timings, timed.cached), kept=timed.kept, timing_note=timed.note
    )
