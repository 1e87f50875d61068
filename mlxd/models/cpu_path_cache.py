"""The CPU path's timings kept under `cache_dir/cpu-paths/`, and the machine's pace when they
were taken, so that timings from a slow spell are not kept for good.

A VM's speed is not steady. On the 2-core Zen 4 KVM of 2026-11-29, identical one-thread kernel
runs took 2–3x their usual time for about an hour, while the kernel counted under 2% steal
time and no other runnable task (a neighbour on the host's other hyperthread or memory looks
like that), so `machine_busy` could not see it. A first load timed then kept the float layout
for one stream at 0.96x llama.cpp's speed where the quiet machine's timings took the int8 dot
products (1.35x), and every later load read that choice from the cache.

So each record keeps the machine's pace as it timed: the time of one fixed call (`pace_ms`,
MLX's own quantized matmul at one row on a 512 × 1024 4-bit matrix, compute-bound on one
thread, ≈ 0.5 ms here, within ±5% from run to run). A load that finds a record measures the
pace again (≈ 10 ms) and times the paths anew where the record's was `UNSTEADY` times slower
than now; a load that times keeps its timings only where the pace before and after agree
within that factor.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxd.models.cpu_path import Timings

UNSTEADY = 1.3  # paces this far apart are two different machines to the timings
_PACE_SHAPE = (512, 1024)
_PACE_GROUP, _PACE_BITS = 32, 4
_PACE_CALLS = 10


@dataclass(frozen=True)
class Record:
    """A cached entry: the timings, and the machine's pace when they were taken."""

    timings: Timings
    pace_ms: float | None  # None: kept before the pace was (then trusted as it is)


class TimingCache:
    """Timings by key under `cache_dir/cpu-paths/` (one small JSON file per key)."""

    def __init__(self, cache_dir: Path) -> None:
        self.root = Path(cache_dir).expanduser() / "cpu-paths"

    @staticmethod
    def key(identity: dict[str, Any]) -> str:
        """A stable key for what the timings depend on: the CPU model, the kernel build and
        the ISA it runs, the probe's code, the BLAS, the thread count and the shapes."""
        text = json.dumps(identity, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def get(self, key: str) -> Record | None:
        try:
            raw = json.loads((self.root / f"{key}.json").read_text())
            pace = raw.get("pace_ms")
            return Record(Timings.from_json(raw["timings"]), None if pace is None else float(pace))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None  # missing or unreadable: time again

    def put(
        self, key: str, identity: dict[str, Any], timings: Timings, pace_ms: float | None
    ) -> None:
        """Best effort: a read-only cache dir costs the next load a timing, nothing else."""
        record = {"identity": identity, "timings": asdict(timings), "pace_ms": pace_ms}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            partial = self.root / f"{key}.json.partial"
            partial.write_text(json.dumps(record, indent=1))
            partial.replace(self.root / f"{key}.json")  # readers never see half a file
        except OSError:
            pass


@functools.cache
def _pace_operands() -> tuple[mx.array, ...]:
    key = mx.random.key(0)
    weight = mx.random.normal(_PACE_SHAPE, key=key, stream=mx.cpu)
    x = mx.random.normal((1, _PACE_SHAPE[1]), key=key, stream=mx.cpu)
    quantized = mx.quantize(weight, group_size=_PACE_GROUP, bits=_PACE_BITS, stream=mx.cpu)
    mx.eval(x, *quantized)
    return (x, *quantized)


def pace_ms() -> float:
    """The machine's pace now: the fastest of a few runs of one fixed small call, in ms.
    MLX's own kernel, not mlxd's: one thread on any thread's stream, whatever the kernels'
    thread settings at the time."""
    x, weight, scales, biases = _pace_operands()

    def run() -> float:
        started = time.perf_counter()
        y = mx.quantized_matmul(
            x, weight, scales, biases, group_size=_PACE_GROUP, bits=_PACE_BITS, stream=mx.cpu
        )
        mx.eval(y)
        return (time.perf_counter() - started) * 1e3

    run()  # a first call's page faults and clock ramp
    return min(run() for _ in range(_PACE_CALLS))
