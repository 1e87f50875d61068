"""Which weights a quantized model computes with on the CPU: packed (mlxd's kernels), float32
(BLAS), or both, decided by timing the two on the model's own shapes. Pure: no MLX here.

The packed kernels beat float32 BLAS on some CPUs and lose to it on others (on a 2-core AVX2
EPYC a SmolLM2 decode step ran 0.79x / 0.31x / 0.11x as fast packed at batch 1 / 8 / 32), and
which wins can differ by batch size: small batches are bound by reading the weights (4 bits
beat 32), large ones by arithmetic (BLAS's). So at load one layer's matmuls and the output
head are timed both ways (models/cpu_path_probe.py) for decode at batch 1, 8 and 32 and for a
prefill chunk, and `decide` picks the plan that is fastest over those phases:

- "packed": every phase on the kernels, on every core, or on one thread where that measured
  faster (when other work holds the cores, a second thread may only add waiting);
- "float32": every phase on BLAS (the weights dequantized: ~8x the bytes of 4-bit);
- "mixed": both weight sets held, each matmul on the faster for its row count (e.g. packed
  decode, float32 prefill). The kernels then run on one thread beside BLAS's (see
  kernels.share_cores), so mixed is judged with the kernels timed on one thread.

A plan is a candidate only when its weights (and the model's KV budget) fit the memory budget:
when float32 does not fit, packed is the only choice, and nothing is timed unless x is taken
as one int8 term (`cpu_activations`, `precise_activations`: then the two packed layouts are). The
timings are cached per CPU, kernel build, BLAS, shape set and `cpu_activations`
(models/cpu_path_cache.py), so only a first load pays for them; the decision itself is
recomputed from them at each load (the budget may change).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

WeightPath = Literal["packed", "float32"]
PLANS = ("packed", "float32", "mixed")
DECODE_BATCHES = (1, 8, 32)
MORE_BYTES_MARGIN = 1.05
# A one-row step estimated under this (ms, matmuls on every core) is a small model's: its
# one-row kernels leave a core to the engine's Python (`Choice.spares_a_core`). Above it the
# step is the weights' bytes, which every core reads faster (a Llama-3.2-1B shape's one-row
# step: 25.6 ms on two cores against 36 on one).
SMALL_STEP_MS = 10.0
# cpu_activations auto: x as one int8 term, llama.cpp's rounding, from this many weights on
# (the kernels' matmuls: a 1B model's layers alone hold 0.97 billion, its quantized head 0.26).
# There the matmuls are most of a step and two terms cost much: a Llama-3.2-1B shape (1.24B)
# served 1 / 8 streams at 14.6 / 28.7 tok/s with two terms against 20.4 / 45.3 with one on an
# AVX2 EPYC, 39–40 / 86–87 against 44 / 124 on an AVX-512 one. Below it two terms cost less
# (SmolLM2-135M: 62.8 / 192.4 against 73.8 / 223.3) and keep mlx-lm's tokens, which a small
# model's answers hang on (SmolLM2 misses "Paris" with one term, as it does under llama.cpp).
ONE_TERM_PARAMETERS = 800_000_000
# From this many rows on the float path dequantizes each chunk of weights into a buffer
# (csrc/qmatmul_tiles.h BUFFER_MIN_ROWS), which the int8 layout's weights can fill as cheaply:
# there its matmuls can run the float path's passes (`Choice.dot_buffer_rows`).
BUFFERED_ROWS = 32


def precise_activations(setting: str, parameters: int) -> bool:
    """Whether the int8 dot products take x as two int8 terms, for `cpu_activations` and a
    model of `parameters` quantized weights."""
    if setting == "auto":
        return parameters < ONE_TERM_PARAMETERS
    return setting == "precise"


@dataclass(frozen=True)
class Phases:
    """The phases timed: decode at each batch size, then one prefill chunk of `prefill` rows."""

    prefill: int
    decode: tuple[int, ...] = DECODE_BATCHES

    @property
    def rows(self) -> tuple[int, ...]:
        return (*self.decode, self.prefill)


@dataclass(frozen=True)
class Timings:
    """Whole-model step estimates in ms per phase (in `Phases.rows` order): `packed` with the
    kernels on every core, `packed_shared` on one thread (beside BLAS), `float32` on BLAS.
    Where float32 does not fit only the packed layouts are timed: `float32` is empty and
    `packed_shared` is `packed`."""

    packed: tuple[float, ...]
    packed_shared: tuple[float, ...]
    float32: tuple[float, ...]
    # `packed` with the weights multiplied as int8 dot products (csrc/qdot.cpp: x as two int8
    # terms, or one under cpu_activations int8); empty where the kernels have no integer dot
    # product.
    packed_dot: tuple[float, ...] = ()
    # The output head's share of `packed` and of `packed_dot` (0 in the prefill phase, which
    # projects only its last rows): each part takes the layout it timed faster in. Empty in
    # timings cached before they were kept: the head then takes the layers' layout.
    head_packed: tuple[float, ...] = ()
    head_dot: tuple[float, ...] = ()

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Timings:
        """The timings from their `asdict` form read back from JSON (the cache, the probe)."""
        return cls(**{k: tuple(map(float, v)) for k, v in raw.items()})

    @property
    def dot_faster(self) -> bool:
        """Whether the layers' int8 dot products ran faster over the phases than their float
        layout (by the margin: the layouts hold the same bytes, so a tie keeps the float one)."""
        if not self.packed_dot:
            return False
        if not self._by_part:
            return _geomean(self.packed_dot, self.packed) < 1 / MORE_BYTES_MARGIN
        return _geomean(self._layers(dot=True), self._layers(dot=False)) < 1 / MORE_BYTES_MARGIN

    @property
    def head_dot_faster(self) -> bool:
        """The same for the output head, over the phases that run it: an 8-bit head (SmolLM2's)
        on AVX2 was the slower as precise's int8 dot products where its 4-bit layers were the
        faster, until those took x as int16 there (csrc/qdot_tiles.h, WIDE)."""
        if not self._by_part:
            return self.dot_faster
        ran = [(d, f) for d, f in zip(self.head_dot, self.head_packed, strict=True) if f > 0]
        dot, float_layout = zip(*ran, strict=True)
        return _geomean(dot, float_layout) < 1 / MORE_BYTES_MARGIN

    @property
    def _by_part(self) -> bool:
        """Whether the head's share was timed (a model with a head the kernels take)."""
        return bool(self.packed_dot and self.head_dot and any(self.head_packed))

    def _layers(self, dot: bool) -> tuple[float, ...]:
        """The layers' share of a packed layout's figures: the whole less the head's."""
        whole, head = (self.packed_dot, self.head_dot) if dot else (self.packed, self.head_packed)
        return tuple(t - h for t, h in zip(whole, head, strict=True))

    def buffered_from(self, phase: int) -> Timings:
        """These timings with the int8 layout's figures from `phase` on those of the float
        layout: what the int8 layout costs where it runs the float path's buffered passes."""
        if not self.packed_dot:
            return self
        head = self.head_dot[:phase] + self.head_packed[phase:] if self.head_dot else ()
        return replace(
            self, packed_dot=self.packed_dot[:phase] + self.packed[phase:], head_dot=head
        )

    def packed_as(self, dot: bool, head_dot: bool) -> tuple[float, ...]:
        """The packed figures on every core with the layers and the head in these layouts."""
        if not self._by_part:
            return self.packed_dot if dot else self.packed
        head = self.head_dot if head_dot else self.head_packed
        return tuple(a + b for a, b in zip(self._layers(dot), head, strict=True))


@dataclass(frozen=True)
class Choice:
    """The plan, each phase's path under it, and what it was decided from."""

    plan: str  # one of PLANS
    paths: tuple[WeightPath, ...]  # per phase, in Phases.rows order
    phases: Phases
    timings: Timings | None  # None: not timed (float32 did not fit)
    weight_bytes: int
    reason: str = ""  # why a plan was out of the running
    cached: bool = False  # the timings came from the cache
    one_thread: bool = False  # the kernels measured faster on one thread (a busy machine)
    # The timings are in the cache for the next load (not those taken on a busy or unsteady
    # machine: `timing_note` says which).
    kept: bool = True
    timing_note: str = ""  # what the load saw of the machine as it timed (models/cpu_path_cache.py)
    # The int8 dot products take x as two int8 terms (cpu_activations precise) or one.
    precise: bool = True

    @property
    def dot(self) -> bool:
        """Whether the packed layers run as int8 dot products: all packed on every core, where
        that layout timed faster (decide compared the plans on the float layout's figures),
        counting from `dot_buffer_rows` on the float layout's figures."""
        return (
            self._packed_on_every_core and self.timings is not None and self._run_timings.dot_faster
        )

    @property
    def head_dot(self) -> bool:
        """The same for the output head, decided apart from the layers."""
        return (
            self._packed_on_every_core
            and self.timings is not None
            and self._run_timings.head_dot_faster
        )

    @property
    def dot_buffer_rows(self) -> int:
        """The rows of x from which matmuls in the int8 layout run the float path's buffered
        passes, their weights dequantized from that layout (0: never). Where the float layout
        timed faster over every phase from a buffered one on (AVX2 at 32 rows: two vpmaddubsw
        per 32 products for precise's two int8 terms, one FMA per product and row buffered),
        the int8 layout then costs what the float layout does there and keeps its own lead
        below. Only where the layers or the head run in the int8 layout."""
        phase = self._buffered_phase
        if phase is None or not (self.dot or self.head_dot):
            return 0
        rows = self.phases.rows
        return max(BUFFERED_ROWS, rows[phase - 1] + 1 if phase else 1)

    @property
    def _buffered_phase(self) -> int | None:
        """The first of the phases from which on the float layout timed faster than the int8
        dot products for the whole model, all with BUFFERED_ROWS rows or more (None: none)."""
        if not self._both_layouts:
            return None
        assert self.timings is not None
        first = None
        for phase in reversed(range(len(self.phases.rows))):
            if self.phases.rows[phase] < BUFFERED_ROWS or (
                self.timings.packed_dot[phase] <= self.timings.packed[phase]
            ):
                break
            first = phase
        return first

    @property
    def _run_timings(self) -> Timings:
        """The timings as the int8 layout would run: buffered from `_buffered_phase` on."""
        assert self.timings is not None
        phase = self._buffered_phase
        return self.timings if phase is None else self.timings.buffered_from(phase)

    @property
    def _packed_on_every_core(self) -> bool:
        return self.plan == "packed" and not self.one_thread

    @property
    def packed_ms(self) -> tuple[float, ...]:
        """The packed figures that apply: on one thread under mixed or `one_thread`, else
        those of the layouts the layers and the head run in."""
        assert self.timings is not None
        if self.dot or self.head_dot:
            return self._run_timings.packed_as(self.dot, self.head_dot)
        one = self.plan == "mixed" or self.one_thread
        return self.timings.packed_shared if one else self.timings.packed

    def path_for(self, rows: int) -> WeightPath:
        """The path of a matmul over `rows` rows: the first phase with at least as many."""
        for phase_rows, path in zip(self.phases.rows, self.paths, strict=True):
            if rows <= phase_rows:
                return path
        return self.paths[-1]

    @property
    def spares_a_core(self) -> bool:
        """Whether one-row kernels leave a core to the rest of the worker: every matmul packed
        on every core and a small model's one-row step (SMALL_STEP_MS). The engine builds each
        step in Python while the kernels compute the last, and hands tokens out; with the
        kernels on both of two cores SmolLM2-135M served one stream at 116–160 tok/s, with a
        core left 172–180 (two runs each, benchmarks.compare). Timing the forward pass alone
        at load did not show it (4.8 against 4.9 ms a step): the engine's own work does."""
        return (
            self.plan == "packed"
            and not self.one_thread
            and self.timings is not None
            and self.packed_ms[0] < SMALL_STEP_MS
        )

    @property
    def activations(self) -> str | None:
        """How the int8 dot products round x (cpu_activations) where the layers or the head
        run them; None: both run in the float layout."""
        return ("precise" if self.precise else "int8") if self.dot or self.head_dot else None

    def summary(self) -> str:
        """One line: which path runs which phase and the timings behind it."""
        if self.timings is None or not self.timings.float32:
            return self._packed_only()
        by_path = {"packed": self.packed_ms, "float32": self.timings.float32}
        parts = []
        for label, indices in (("decode", range(len(self.phases.decode))), ("prefill", [-1])):
            chosen = {self.paths[i] for i in indices}
            path: WeightPath = "packed" if chosen == {"packed"} else "float32"
            if len(chosen) > 1:  # decode split by batch size
                parts.append(_split_decode(self, by_path))
                continue
            other: WeightPath = "float32" if path == "packed" else "packed"
            rows = "/".join(str(self.phases.rows[i]) for i in indices)
            ours = "/".join(_ms(by_path[path][i]) for i in indices)
            theirs = "/".join(_ms(by_path[other][i]) for i in indices)
            parts.append(f"{path} {label} ({rows}: {ours} ms vs {other} {theirs})")
        return ", ".join(parts) + self._notes()

    def _packed_only(self) -> str:
        """The summary where float32 does not fit: the packed layouts' timings, if taken."""
        if self.timings is None:
            return f"packed ({self.reason})"
        rows = "/".join(str(rows) for rows in self.phases.rows)
        ours = "/".join(_ms(ms) for ms in self.packed_ms)
        return f"packed ({rows}: {ours} ms{self._layouts()})" + self._notes()

    def _notes(self) -> str:
        note = "; kernels on one thread" if self.one_thread else ""
        if self.dot and self.head_dot:
            note += "; int8 dot products"
        elif self.dot:
            note += "; int8 dot products, the head in the float layout"
        elif self.head_dot:
            note += "; the head as int8 dot products, the layers in the float layout"
        elif self._both_layouts:
            note += "; the float layout"
        note += ", x as one int8 term" if self.activations == "int8" else ""
        if self.dot_buffer_rows:
            note += f", from {self.dot_buffer_rows} rows dequantized into the float path's passes"
        if self.timings is not None and self.timings.float32:
            note += self._layouts()
        note += "; one-row kernels leave a core to the engine" if self.spares_a_core else ""
        note += f"; {self.reason}" if self.reason else ""
        note += f"; {self.timing_note}" if self.timing_note else ""
        return note + (" [cached timings]" if self.cached else "")

    @property
    def _both_layouts(self) -> bool:
        """Whether the packed weights run on every core with both layouts timed."""
        return (
            self._packed_on_every_core
            and self.timings is not None
            and bool(self.timings.packed_dot)
        )

    def _layouts(self) -> str:
        """All packed on every core with both layouts timed: each one's figures for the whole
        model, beside those of the mix taken. Mixed and one-thread plans run the float layout
        they were timed with."""
        if not self._both_layouts:
            return ""
        assert self.timings is not None
        cells = [
            f"{name} {'/'.join(_ms(ms) for ms in figures)} ms"
            for name, figures in (
                ("float layout", self.timings.packed),
                ("int8 dot products", self.timings.packed_dot),
            )
        ]
        return " (whole model: " + ", ".join(cells) + ")"

    def as_dict(self) -> dict[str, Any]:
        """For /v1/status: the plan, the summary, per phase the path and both timings."""
        phases = []
        for i, rows in enumerate(self.phases.rows):
            name = f"prefill {rows}" if i == len(self.phases.rows) - 1 else f"decode {rows}"
            phase: dict[str, Any] = {"phase": name, "path": self.paths[i]}
            if self.timings is not None:
                phase["packed_ms"] = round(self.packed_ms[i], 2)
            if self.timings is not None and self.timings.float32:
                phase["float32_ms"] = round(self.timings.float32[i], 2)
            phases.append(phase)
        return {
            "plan": self.plan,
            "summary": self.summary(),
            "phases": phases,
            "weight_bytes": self.weight_bytes,
            "cached": self.cached,
            "kept": self.kept,
            "timing_note": self.timing_note,
            "one_thread": self.one_thread,
            "dot": self.dot,
            "head_dot": self.head_dot,
            "dot_buffer_rows": self.dot_buffer_rows,
            "activations": self.activations,
            "spares_a_core": self.spares_a_core,
            "reason": self.reason or None,
        }


def _ms(value: float) -> str:
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _split_decode(choice: Choice, by_path: dict[str, tuple[float, ...]]) -> str:
    cells = []
    for i, rows in enumerate(choice.phases.decode):
        path = choice.paths[i]
        other = "float32" if path == "packed" else "packed"
        cells.append(f"{rows}: {path} {_ms(by_path[path][i])} vs {_ms(by_path[other][i])} ms")
    return "decode (" + "; ".join(cells) + ")"


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f} GiB"


def _every(phases: Phases, path: WeightPath) -> tuple[WeightPath, ...]:
    return (path,) * len(phases.rows)


def decide(
    phases: Phases,
    timings: Timings | None,
    *,
    packed_bytes: int,
    float32_bytes: int,
    kv_bytes: int,
    budget: int,
    cached: bool = False,
    precise: bool = True,
) -> Choice:
    """The fastest plan whose weights plus `kv_bytes` fit `budget`; `precise` as Choice's.

    Fastest: the lowest geometric mean over the phases of the plan's time over the best time
    any candidate plan reaches in that phase. A plan holding more bytes wins only by
    `MORE_BYTES_MARGIN` (float32 over packed, mixed over either).
    `timings` may be None, or hold the packed layouts' alone, only when float32 does not fit
    (then packed is the only plan, on the int8 dot products where those timed faster).
    """
    all_packed, all_float32 = _every(phases, "packed"), _every(phases, "float32")
    if float32_bytes + kv_bytes > budget:
        reason = (
            f"float32 weights ({_gib(float32_bytes)}) do not fit the memory budget ({_gib(budget)})"
        )
        return Choice(
            "packed", all_packed, phases, timings, packed_bytes, reason, cached, precise=precise
        )
    if timings is None or not timings.float32:
        raise ValueError("float32 fits the budget: the paths must be timed")
    # All packed, the kernels on every core or on one, whichever ran faster over the phases
    # (when other work holds the cores a second thread may only add waiting).
    one_thread = _geomean(timings.packed_shared, timings.packed) < 1 / MORE_BYTES_MARGIN
    candidates: dict[str, tuple[tuple[WeightPath, ...], int, tuple[float, ...]]] = {
        "packed": (
            all_packed,
            packed_bytes,
            timings.packed_shared if one_thread else timings.packed,
        ),
        "float32": (all_float32, float32_bytes, timings.float32),
    }
    mixed_paths: tuple[WeightPath, ...] = tuple(
        "packed" if p < f else "float32"
        for p, f in zip(timings.packed_shared, timings.float32, strict=True)
    )
    reason = ""
    if len(set(mixed_paths)) > 1:
        mixed_bytes = packed_bytes + float32_bytes
        if mixed_bytes + kv_bytes <= budget:
            mixed_ms = tuple(
                min(p, f) for p, f in zip(timings.packed_shared, timings.float32, strict=True)
            )
            candidates["mixed"] = (mixed_paths, mixed_bytes, mixed_ms)
        else:
            reason = (
                f"both weight sets ({_gib(mixed_bytes)}) do not fit the memory budget "
                f"({_gib(budget)})"
            )
    best = [min(c[2][i] for c in candidates.values()) for i in range(len(phases.rows))]

    def score(item: tuple[str, tuple[tuple[WeightPath, ...], int, tuple[float, ...]]]) -> float:
        return _geomean(item[1][2], tuple(best))

    # Fewest bytes first; a plan holding more must be clearly faster (timings are noisy).
    ranked = sorted(candidates.items(), key=lambda item: item[1][1])
    plan, (paths, nbytes, _) = ranked[0]
    best_score = score(ranked[0])
    for item in ranked[1:]:
        if score(item) * MORE_BYTES_MARGIN < best_score:
            plan, (paths, nbytes, _) = item
            best_score = score(item)
    one_thread = one_thread and plan == "packed"
    return Choice(plan, paths, phases, timings, nbytes, reason, cached, one_thread, precise=precise)


def _geomean(times: tuple[float, ...], reference: tuple[float, ...]) -> float:
    """The geometric mean of times[i] / reference[i]."""
    ratios = [t / r for t, r in zip(times, reference, strict=True)]
    return math.exp(sum(map(math.log, ratios)) / len(ratios))
