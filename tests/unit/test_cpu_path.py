"""The CPU path decision (models/cpu_path.py) with faked timings, and its timing cache."""

from __future__ import annotations

import json
import math
import os

import pytest

from mlxd.models.cpu_path import Choice, Phases, Timings, decide
from mlxd.models.cpu_path_cache import Record, TimingCache

PHASES = Phases(prefill=512)  # rows 1, 8, 32, 512
GiB = 2**30
# The 2-core AVX2 EPYC of issue 25: packed wins batch 1 only (when on every core).
EPYC = Timings(
    packed=(8.0, 40.0, 160.0, 2000.0),
    packed_shared=(9.0, 45.0, 170.0, 2200.0),
    float32=(10.0, 12.0, 18.0, 300.0),
)


def choose(timings: Timings | None, budget: int = 64 * GiB, kv: int = 0) -> Choice:
    return decide(
        PHASES,
        timings,
        packed_bytes=1 * GiB,
        float32_bytes=6 * GiB,
        kv_bytes=kv,
        budget=budget,
    )


def test_packed_everywhere_when_it_is_faster_everywhere():
    fast = Timings((5.0, 6.0, 8.0, 100.0), (6.0, 8.0, 12.0, 150.0), (9.0, 15.0, 30.0, 200.0))
    choice = choose(fast)
    assert (choice.plan, choice.weight_bytes) == ("packed", 1 * GiB)
    assert choice.paths == ("packed",) * 4


def test_float32_everywhere_when_it_is_faster_everywhere():
    slow = Timings(
        (20.0, 60.0, 200.0, 900.0), (25.0, 70.0, 240.0, 1000.0), (9.0, 15.0, 30.0, 200.0)
    )
    choice = choose(slow)
    assert (choice.plan, choice.weight_bytes) == ("float32", 6 * GiB)
    assert choice.path_for(1) == choice.path_for(4096) == "float32"


def test_packed_decode_and_float32_prefill_hold_both_weight_sets():
    split = Timings((4.0, 6.0, 9.0, 900.0), (5.0, 7.0, 11.0, 950.0), (9.0, 15.0, 30.0, 200.0))
    choice = choose(split)
    assert choice.plan == "mixed"
    assert choice.paths == ("packed", "packed", "packed", "float32")
    assert choice.weight_bytes == 7 * GiB
    assert [choice.path_for(rows) for rows in (1, 5, 32, 33, 512, 4096)] == [
        "packed", "packed", "packed", "float32", "float32", "float32"
    ]  # fmt: skip
    assert "packed decode (1/8/32: 5.0/7.0/11.0 ms vs float32 9.0/15.0/30.0)" in choice.summary()
    assert "float32 prefill (512: 200 ms vs packed 950)" in choice.summary()


def test_mixed_is_judged_with_the_kernels_on_one_thread():
    # On every core packed wins decode; on one thread (beside BLAS) it loses it: no mixed plan,
    # and packed (1x at decode, 4.5x slower at prefill) beats float32 (2.2-3.3x at decode).
    timings = Timings((4.0, 6.0, 9.0, 900.0), (12.0, 20.0, 40.0, 1800.0), (9.0, 15.0, 30.0, 200.0))
    assert choose(timings).plan == "packed"


def test_packed_on_one_thread_where_the_cores_are_busy():
    # Measured on 2 cores at load average 15: OpenMP's two-thread team stalled.
    busy = Timings(
        (12714.0, 9840.0, 9657.0, 15328.0),
        (4.8, 12.4, 348.0, 2753.0),
        (308.0, 674.0, 545.0, 6790.0),
    )
    choice = choose(busy)
    assert (choice.plan, choice.one_thread) == ("packed", True)
    assert choice.summary().startswith("packed decode (1/8/32: 4.8/12.4/348 ms vs float32")
    assert "kernels on one thread" in choice.summary()
    assert choice.as_dict()["phases"][0]["packed_ms"] == 4.8


def test_holding_more_bytes_must_be_clearly_faster():
    close = Timings((9.8, 14.9, 29.0, 195.0), (9.9, 15.0, 29.5, 198.0), (9.0, 15.0, 30.0, 200.0))
    # float32 8% faster at batch 1, packed 1-3% faster elsewhere: not worth 6x the bytes
    assert choose(close).plan == "packed"


def test_the_epyc_of_issue_25_runs_float32():
    # Packed wins batch 1 by 10-20% and loses 8/32/prefill by 3-9x: float32 overall (holding
    # both sets for batch 1 alone is not clearly faster).
    choice = choose(EPYC)
    assert choice.plan == "float32"
    assert "float32 decode (1/8/32: 10.0/12.0/18.0 ms vs packed 8.0/40.0/160)" in choice.summary()


def test_float32_that_does_not_fit_leaves_packed_and_says_so():
    choice = choose(None, budget=4 * GiB)
    assert choice.plan == "packed" and choice.timings is None
    assert choice.summary() == (
        "packed (float32 weights (6.00 GiB) do not fit the memory budget (4.00 GiB))"
    )


def test_the_kv_budget_counts_against_the_memory_budget():
    assert choose(EPYC, budget=7 * GiB, kv=512 * 2**20).plan == "float32"
    assert choose(None, budget=7 * GiB, kv=2 * GiB).plan == "packed"


def test_mixed_that_does_not_fit_falls_back_to_one_set():
    split = Timings((4.0, 6.0, 9.0, 900.0), (5.0, 7.0, 11.0, 950.0), (9.0, 15.0, 30.0, 200.0))
    choice = choose(split, budget=6 * GiB)
    assert choice.plan in ("packed", "float32")
    assert "both weight sets (7.00 GiB) do not fit" in choice.summary()


def test_timings_are_required_when_float32_fits():
    with pytest.raises(ValueError, match="timed"):
        choose(None)


def test_status_shows_each_phase_with_both_figures():
    status = choose(EPYC).as_dict()
    assert status["plan"] == "float32"
    assert status["phases"][0] == {
        "phase": "decode 1", "path": "float32", "packed_ms": 8.0, "float32_ms": 10.0
    }  # fmt: skip
    assert status["phases"][-1]["phase"] == "prefill 512"


def identity(**changes: object) -> dict[str, object]:
    base: dict[str, object] = {
        "cpu": "AMD EPYC",
        "kernels": "abc123",
        "probe": "abc123",
        "isa": "avx2",
        "shapes": [[576, 1536, 32, 4]],
        "phases": [1, 8, 32, 512],
    }
    return base | changes


def test_timings_are_cached_by_cpu_kernel_build_and_shapes(tmp_path):
    cache = TimingCache(tmp_path)
    key = TimingCache.key(identity())
    assert cache.get(key) is None
    cache.put(key, identity(), EPYC, 0.5)
    assert TimingCache(tmp_path).get(TimingCache.key(identity())) == Record(EPYC, 0.5)
    for changed in (
        identity(kernels="def456"),  # a rebuilt kernel module
        identity(probe="def456"),  # a probe that times another way
        identity(isa="avx512"),
        identity(cpu="Intel Xeon"),
        identity(shapes=[[2048, 8192, 64, 4]]),
        identity(phases=[1, 8, 32, 2048]),
    ):
        assert cache.get(TimingCache.key(changed)) is None


def test_a_probe_that_times_another_way_keys_anew(tmp_path, monkeypatch):
    """The key names the probe's code by its file's hash, as it names the kernel build: a
    probe changed in how it times keys anew though the shapes and kernels are the same."""
    import importlib.util
    from types import SimpleNamespace

    from mlxd.models import cpu_path_timing
    from mlxd.models.cpu_path_probe import ModelShapes

    probe = tmp_path / "cpu_path_probe.py"
    real = importlib.util.find_spec

    def find_spec(name: str) -> object:
        return SimpleNamespace(origin=str(probe)) if name.endswith("cpu_path_probe") else real(name)

    monkeypatch.setattr(cpu_path_timing.importlib.util, "find_spec", find_spec)
    shapes = ModelShapes(((576, 1536, 32, 4),), None, 30)
    keys = []
    for source in ("rows = 8", "rows = 8", "rows = 16"):
        probe.write_text(source)
        keys.append(TimingCache.key(cpu_path_timing.identity(shapes, PHASES)))
    assert keys[0] == keys[1] != keys[2]


def test_a_cached_decision_says_so(tmp_path):
    choice = decide(
        PHASES, EPYC, packed_bytes=GiB, float32_bytes=6 * GiB, kv_bytes=0, budget=64 * GiB,
        cached=True,
    )  # fmt: skip
    assert choice.cached and choice.summary().endswith("[cached timings]")


def test_an_unreadable_cache_entry_means_timing_again(tmp_path):
    cache = TimingCache(tmp_path)
    key = TimingCache.key(identity())
    cache.root.mkdir(parents=True)
    (cache.root / f"{key}.json").write_text("{not json")
    assert cache.get(key) is None


def test_split_layers_run_each_row_count_on_its_path(monkeypatch):
    import mlx.core as mx
    import mlx.nn as nn

    from mlxd import kernels
    from mlxd.models.packed import SplitLinear, pack_model

    model = nn.Sequential(nn.Linear(64, 64))
    nn.quantize(model, group_size=32, bits=4)
    reference = model.layers[0]
    x = mx.random.normal((16, 64))
    expected = reference(x)
    split = nn.Sequential(nn.Linear(64, 64))
    nn.quantize(split, group_size=32, bits=4)
    split.update(model.parameters())
    pack_model(split, lambda rows: "packed" if rows <= 8 else "float32")
    assert isinstance(split.layers[0], SplitLinear)

    packed_calls = []
    qmatmul = kernels.qmatmul
    monkeypatch.setattr(kernels, "qmatmul", lambda *a: packed_calls.append(1) or qmatmul(*a))
    for rows, calls in ((4, 1), (16, 1)):
        y = split(x[:rows])
        assert mx.allclose(y, expected[:rows], atol=1e-4).item()
        assert len(packed_calls) == calls


def test_time_paths_gives_a_figure_per_phase_and_path():
    from mlxd.models.cpu_path_probe import ModelShapes
    from mlxd.models.cpu_path_timing import time_paths

    shapes = ModelShapes(layer=((64, 64, 32, 4), (128, 64, 32, 4)), head=(256, 64, 32, 8), layers=2)
    timings = time_paths(shapes, Phases(prefill=16))
    for figures in (timings.packed, timings.packed_shared, timings.float32):
        assert len(figures) == 4 and all(ms > 0 for ms in figures)
    # The int8 dot products' layout, where the kernels have an integer dot product.
    from mlxd import kernels

    assert len(timings.packed_dot) == (4 if kernels.integer_dot() else 0)
    assert all(ms > 0 for ms in timings.packed_dot)


def test_paths_are_timed_in_turn_and_one_far_behind_is_not_run_again():
    import time

    import mlx.core as mx

    from mlxd.models import cpu_path_probe

    runs: list[str] = []

    def run(name: str, seconds: float = 0.0):
        def once() -> list[mx.array]:
            runs.append(name)
            time.sleep(seconds)
            return [mx.ones((4,)) * len(runs)]

        return once

    best = cpu_path_probe._best_ms([run("a"), run("b")], 3, warm_up=True, give_up_ms=math.inf)
    assert all(ms > 0 for ms in best)
    assert runs == ["a", "b"] * 4  # the warm-up, then a run of each in turn
    # Behind by more than GIVE_UP times after two runs (one alone may be a stall): no third.
    runs.clear()
    cpu_path_probe._best_ms([run("a"), run("slow", 0.05)], 4, warm_up=False, give_up_ms=math.inf)
    assert runs == ["a", "slow", "a", "slow", "a", "a"]
    runs.clear()
    cpu_path_probe._best_ms([run("a")], 3, warm_up=False, give_up_ms=0.0)  # behind a bar
    assert runs == ["a", "a"]


def test_float32_gives_up_at_twice_the_slowest_packed_figure(monkeypatch):
    from mlxd import kernels
    from mlxd.models import cpu_path_probe
    from mlxd.models.cpu_path_probe import GIVE_UP, ModelShapes, time_paths

    calls: list[tuple[int, int, list[str], float, list[float]]] = []
    time_them = cpu_path_probe._time

    def timed(matrices, rows, layouts, prefill, warm_up, give_up_ms):
        ms = time_them(matrices, rows, layouts, prefill, warm_up, give_up_ms)
        if layouts != ["float32"]:
            assert give_up_ms == math.inf  # the packed layouts: in full, against each other
        calls.append((id(matrices), rows, list(layouts), give_up_ms, ms))
        return ms

    monkeypatch.setattr(cpu_path_probe, "_time", timed)
    shapes = ModelShapes(layer=((64, 64, 32, 4),), head=(256, 64, 32, 4), layers=2)
    timings = time_paths(shapes, Phases(prefill=16))  # in this process
    assert all(ms > 0 for ms in timings.float32)
    # On every core both packed layouts in turn where the kernels have int8 dot products.
    every_core = ["dot", "float"] if kernels.integer_dot() else ["float"]
    assert [c[2] for c in calls if c[2] != ["float32"]] == [every_core] * 7 + [["float"]] * 7
    float32 = [call for call in calls if call[2] == ["float32"]]
    # Per phase the layer's pass and (decode) the head's, each against every packed layout's
    # figure for the same pass: the float layout, the int8 dot products', on one thread.
    assert [rows for _, rows, *_ in float32] == [1, 1, 8, 8, 32, 32, 16]
    for part, rows, _, bar, _ in float32:
        packed = [
            ms
            for p, r, layouts, _, figures in calls
            if layouts != ["float32"] and (p, r) == (part, rows)
            for ms in figures
        ]
        assert len(packed) == len(every_core) + 1 and bar == GIVE_UP * max(packed)


def test_the_head_takes_the_layout_it_timed_faster_apart_from_the_layers():
    """On AVX2 SmolLM2's 4-bit layers are faster as int8 dot products and its 8-bit head in the
    float layout: each part takes its own, and the figures are the mix's."""
    whole = ((5.0, 6.0, 8.0, 100.0), (6.0, 8.0, 12.0, 150.0), (9.0, 15.0, 30.0, 200.0))
    # Layers: float 4/4/4/100, dot 2/3/3/95; head: float 1/2/4/0, dot 2/4/6/0.
    timings = Timings(*whole, (4.0, 7.0, 9.0, 95.0), (1.0, 2.0, 4.0, 0.0), (2.0, 4.0, 6.0, 0.0))
    choice = choose(timings)
    assert choice.plan == "packed" and choice.dot and not choice.head_dot
    assert choice.packed_ms == (3.0, 5.0, 7.0, 95.0)
    assert "int8 dot products, the head in the float layout" in choice.summary()
    assert choice.as_dict()["head_dot"] is False and choice.activations == "precise"
    # The other way round, and both: the head alone as int8 dot products.
    head_only = Timings(*whole, (6.0, 6.0, 7.0, 110.0), (1.0, 2.0, 4.0, 0.0), (0.5, 1.0, 2.0, 0.0))
    choice = choose(head_only)
    assert not choice.dot and choice.head_dot and choice.packed_ms == (4.5, 5.0, 6.0, 100.0)
    assert "the head as int8 dot products, the layers in the float layout" in choice.summary()
    # Timings cached before the head's share was kept: the head follows the layers.
    old = Timings(*whole, (4.0, 5.0, 7.0, 90.0))
    assert choose(old).dot and choose(old).head_dot
    assert choose(old).packed_ms == old.packed_dot


def test_the_int8_dot_layout_runs_where_it_timed_clearly_faster_all_packed(tmp_path):
    fast = Timings((5.0, 6.0, 8.0, 100.0), (6.0, 8.0, 12.0, 150.0), (9.0, 15.0, 30.0, 200.0))
    dot = Timings(*(fast.packed, fast.packed_shared, fast.float32), (4.0, 5.0, 7.0, 90.0))
    choice = choose(dot)
    assert choice.plan == "packed" and choice.dot
    assert choice.packed_ms == dot.packed_dot and "int8 dot products" in choice.summary()
    # The summary gives both layouts' figures for the whole model.
    both = "(whole model: float layout 5.0/6.0/8.0/100 ms, int8 dot products 4.0/5.0/7.0/90.0 ms)"
    assert both in choice.summary()
    assert choice.as_dict()["dot"] is True
    assert choice.as_dict()["phases"][0]["packed_ms"] == 4.0
    # A tie (same bytes either way) keeps the float layout; no dot figures: the float layout.
    tie = Timings(*(fast.packed, fast.packed_shared, fast.float32), (5.0, 6.0, 8.0, 99.0))
    assert not choose(tie).dot and not choose(fast).dot
    assert (
        "; the float layout (whole model: float layout 5.0/6.0/8.0/100 ms" in choose(tie).summary()
    )
    # Mixed and one-thread plans run the float layout they were timed with.
    split = Timings(
        (4.0, 6.0, 9.0, 900.0), (5.0, 7.0, 11.0, 950.0), (9.0, 15.0, 30.0, 200.0),
        (2.0, 3.0, 4.0, 400.0),
    )  # fmt: skip
    assert choose(split).plan == "mixed" and not choose(split).dot
    cache = TimingCache(tmp_path)
    cache.put(TimingCache.key(identity()), identity(), dot, None)
    assert cache.get(TimingCache.key(identity())) == Record(dot, None)


def test_the_int8_layout_runs_the_float_paths_passes_where_those_timed_faster():
    """AVX2: the int8 dot products lead at one row and lose from 32 rows on, where both
    layouts can run the float path's buffered passes. The int8 layout is then taken for its
    lead, and runs those passes from 32 rows (their figures the float layout's)."""
    whole = ((4.0, 10.0, 20.0, 200.0), (6.0, 14.0, 30.0, 300.0), (9.0, 15.0, 30.0, 250.0))
    # Over every phase the int8 figures alone lose (a geometric mean of 1.08).
    avx2 = Timings(*whole, (3.0, 10.0, 24.0, 300.0))
    choice = choose(avx2)
    assert choice.plan == "packed" and choice.dot and choice.dot_buffer_rows == 32
    assert choice.packed_ms == (3.0, 10.0, 20.0, 200.0)
    assert "from 32 rows dequantized into the float path's passes" in choice.summary()
    assert choice.as_dict()["dot_buffer_rows"] == 32
    # The float layout faster at the prefill chunk alone: buffered above the 32-row phase.
    prefill = Timings(*whole, (3.0, 10.0, 19.0, 300.0))
    assert choose(prefill).dot_buffer_rows == 33
    assert choose(prefill).packed_ms == (3.0, 10.0, 19.0, 200.0)
    # Faster at the prefill chunk as int8 dot products: no phase from which the float layout
    # leads throughout, so no buffered passes (and over the phases the float layout is taken).
    mid = Timings(*whole, (3.0, 10.0, 24.0, 190.0))
    assert choose(mid).dot_buffer_rows == 0
    # The float layout taken (no lead at one row): no buffered passes to speak of.
    no_lead = Timings(*whole, (4.0, 10.0, 24.0, 300.0))
    assert not choose(no_lead).dot and choose(no_lead).dot_buffer_rows == 0
    assert "dequantized" not in choose(no_lead).summary()
    # By part: from 32 rows both parts' int8 figures are the float layout's.
    by_part = Timings(*whole, (3.0, 11.0, 24.0, 300.0), (1.0, 2.0, 4.0, 0.0), (2.0, 3.0, 5.0, 0.0))
    choice = choose(by_part)
    assert choice.dot and not choice.head_dot and choice.dot_buffer_rows == 32
    assert choice.packed_ms == (2.0, 10.0, 20.0, 200.0)
    # Mixed and one-thread plans run the float layout: nothing to buffer.
    split = Timings(
        (4.0, 6.0, 9.0, 900.0), (5.0, 7.0, 11.0, 950.0), (9.0, 15.0, 30.0, 200.0),
        (2.0, 6.0, 12.0, 1000.0),
    )  # fmt: skip
    assert choose(split).plan == "mixed" and choose(split).dot_buffer_rows == 0


def test_the_int8_dot_layout_computes_the_model_as_its_float32_twin(smol) -> None:
    """SmolLM2 Q4_1 packed as int8 dot products (precise: x as two int8 terms): logits within
    0.05 of the float32 twin's (the float layout's: 2e-3; x's rounding adds 1/64,516 of each
    block's largest |x|), and greedy decoding to the token."""
    import mlx.core as mx

    from mlxd.models.loader import load_llm
    from mlxd.models.packed import PackedLinear, pack_model
    from tests.unit.test_kernels import _greedy

    model = load_llm(smol.path, dtype="keep", model_name="smol").model
    model.set_dtype(mx.float32)
    pack_model(model, dot=True)
    packed = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    # The tied embedding's table too: its lookups read that layout.
    assert "model.embed_tokens.output" in packed
    assert all(m.dot and m.precise for m in packed.values())
    for prompt in ("The capital of France is", "def fibonacci(n):", "Water boils at"):
        ids = mx.array([smol.tokenizer.encode(prompt)])
        assert mx.allclose(model(ids), smol.model(ids), atol=5e-2).item()
        assert _greedy(model, ids) == _greedy(smol.model, ids)


def test_the_head_packs_in_its_own_layout(smol) -> None:
    """`head_dot` apart from `dot`: SmolLM2's tied 8-bit head in the float layout beside its
    layers as int8 dot products, and the other way round; the same logits either way."""
    import mlx.core as mx

    from mlxd.models.loader import load_llm
    from mlxd.models.packed import PackedLinear, pack_model
    from tests.unit.test_kernels import _greedy

    ids = mx.array([smol.tokenizer.encode("The capital of France is")])
    for dot, head_dot in ((True, False), (False, True)):
        model = load_llm(smol.path, dtype="keep", model_name="smol").model
        model.set_dtype(mx.float32)
        pack_model(model, dot=dot, head_dot=head_dot)
        packed = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
        head = packed.pop("model.embed_tokens.output")
        assert head.dot == head_dot and all(m.dot == dot for m in packed.values())
        assert mx.allclose(model(ids), smol.model(ids), atol=5e-2).item()
        assert _greedy(model, ids) == _greedy(smol.model, ids)


def test_one_int8_term_computes_the_model_as_llama_cpp_rounds_it(smol) -> None:
    """cpu_activations int8: x as one int8 term per block of 32, as llama.cpp's Q8 (1/254 of
    the block's largest |x|). The logits part from the float32 twin's by more than the
    precise layout's (up to ≈1.8 over every position of SmolLM2, whose activations have
    outliers), but the last position's stay within 2 and its greedy token is the twin's."""
    import mlx.core as mx

    from mlxd.models.loader import load_llm
    from mlxd.models.packed import PackedLinear, pack_model

    model = load_llm(smol.path, dtype="keep", model_name="smol").model
    model.set_dtype(mx.float32)
    pack_model(model, dot=True, precise=False)
    packed = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert "model.embed_tokens.output" in packed
    assert all(m.dot and not m.precise for m in packed.values())
    for prompt in ("The capital of France is", "def fibonacci(n):", "Water boils at"):
        ids = mx.array([smol.tokenizer.encode(prompt)])
        ours, twin = model(ids)[0, -1], smol.model(ids)[0, -1]
        gap = mx.abs(ours - twin).max().item()
        assert 0 < gap < 2.0  # 0.66 to 0.84 here; the precise layout's stay under 0.05
        assert mx.argmax(ours).item() == mx.argmax(twin).item()


def test_one_int8_term_streams_float32_scales_as_float16() -> None:
    """A K-quant GGUF's float32 scales and biases (d times a 6-bit scale: no float16 holds
    most) are packed as float16 under llama.cpp's rounding of x, 5 bits a 4-bit weight instead
    of 6; the precise and float layouts keep them exact, and so does a layer with a value past
    float16's range. Each weight moves by at most 2^-11 of its scale and bias terms."""
    import mlx.core as mx

    from mlxd import kernels
    from mlxd.models.packed import pack

    weight, scales, biases = mx.quantize(
        mx.random.normal((64, 256), key=mx.random.key(1)) * 0.05, group_size=32, bits=4
    )
    assert not mx.array_equal(scales.astype(mx.float16).astype(mx.float32), scales).item()
    one_term = pack(weight, scales, biases, 32, 4, dot=True, precise=False)
    assert one_term.scale_bias.dtype == mx.float16
    assert pack(weight, scales, biases, 32, 4, dot=True).scale_bias.dtype == mx.float32
    assert pack(weight, scales, biases, 32, 4).scale_bias.dtype == mx.float32
    past_range = scales.at[0, 0].add(1e5)
    assert pack(weight, past_range, biases, 32, 4, dot=True, precise=False).scale_bias.dtype == (
        mx.float32
    )

    x = mx.random.normal((5, 256), key=mx.random.key(2))
    exact = kernels.pack_dot(weight, scales, biases, 32, 4, precise=False)
    assert exact.scale_bias.dtype == mx.float32  # the kernels' own packing stays exact
    moved = mx.repeat(2.0**-11 * (mx.abs(scales) * 15 + mx.abs(biases)), 32, axis=1)
    # The same int8 x on both sides: |x8 d| <= |x| + d / 2.
    bound = (mx.abs(x) + mx.abs(x).max() / 254) @ moved.T + 1e-6
    gap = mx.abs(kernels.qmatmul(x, one_term) - kernels.qmatmul(x, exact))
    assert (gap <= bound).all().item()
    assert gap.max().item() > 0  # the rounding did happen


def test_int8_activations_time_the_packed_layouts_where_float32_does_not_fit(
    smol_packed, tmp_path, monkeypatch
):
    """With x as one int8 term the int8 dot products can be much the faster layout, so where
    float32 does not fit the two packed layouts are still timed (not float32: nothing to
    compare it with)."""
    from mlxd import kernels
    from mlxd.config import ModelConfig, ServerConfig
    from mlxd.models import cpu_path_timing

    timed = []
    dot_faster = Timings((5.0, 6.0, 8.0, 100.0), (5.0, 6.0, 8.0, 100.0), (), (3.0, 4.0, 5.0, 90.0))

    def fake(shapes, phases, precise, float32):
        timed.append((precise, float32))
        return dot_faster

    monkeypatch.setattr(cpu_path_timing, "time_paths", fake)
    monkeypatch.setattr(cpu_path_timing, "_timed", {})
    monkeypatch.setattr(cpu_path_timing, "machine_busy", lambda: False)
    monkeypatch.setattr(cpu_path_timing, "pace_ms", lambda: 1.0)
    monkeypatch.setattr(kernels, "integer_dot", lambda: True)
    tight = ServerConfig(cache_dir=tmp_path, memory_budget=300 * 2**20)
    config = ModelConfig(kind="llm", source=str(smol_packed.path), cpu_activations="int8")
    choice = cpu_path_timing.choose_cpu_path(smol_packed.path, config, tight)
    assert timed == [(False, False)]
    assert choice is not None and choice.plan == "packed" and choice.dot
    assert choice.activations == "int8" and choice.packed_ms == dot_faster.packed_dot
    summary = choice.summary()
    assert (
        "(1/8/32/256: 3.0/4.0/5.0/90.0 ms (whole model: float layout 5.0/6.0/8.0/100 ms" in summary
    )
    assert "x as one int8 term" in summary and "do not fit the memory budget" in summary
    phase = choice.as_dict()["phases"][0]
    assert phase == {"phase": "decode 1", "path": "packed", "packed_ms": 3.0}
    assert choice.as_dict()["activations"] == "int8"
    # Cached under their own key: the next worker reads them; precise times nothing.
    monkeypatch.setattr(cpu_path_timing, "_timed", {})
    again = cpu_path_timing.choose_cpu_path(smol_packed.path, config, tight)
    assert again is not None and again.cached and again.dot and len(timed) == 1
    precise = ModelConfig(kind="llm", source=str(smol_packed.path))
    choice = cpu_path_timing.choose_cpu_path(smol_packed.path, precise, tight)
    assert choice is not None and choice.timings is None and not choice.dot and len(timed) == 1
    # Where float32 fits, the one-term layout is timed beside it (its own cache key).
    roomy = ServerConfig(cache_dir=tmp_path)
    monkeypatch.setattr(
        cpu_path_timing, "time_paths", lambda s, p, *args: timed.append(args) or EPYC
    )
    cpu_path_timing.choose_cpu_path(smol_packed.path, config, roomy)
    assert timed[-1] == (False, True)


def test_auto_activations_take_one_int8_term_from_a_billion_weights(smol_packed):
    from mlxd.models.cpu_path import precise_activations
    from mlxd.models.cpu_path_probe import ModelShapes
    from mlxd.models.cpu_path_timing import model_shapes

    smol = model_shapes(smol_packed.path)
    assert smol is not None and 130e6 < smol.parameters < 140e6  # SmolLM2-135M
    hidden, kv, ffn = 2048, 512, 8192  # Llama-3.2-1B: 16 layers, a 128,256-token head
    layer = [(hidden, hidden, 64, 4), (kv, hidden, 64, 4), (kv, hidden, 64, 4)]
    layer += [(hidden, hidden, 64, 4), (ffn, hidden, 64, 4), (ffn, hidden, 64, 4)]
    llama = ModelShapes((*layer, (hidden, ffn, 64, 4)), (128256, hidden, 64, 4), 16)
    assert 1.2e9 < llama.parameters < 1.3e9
    assert precise_activations("auto", smol.parameters)
    assert not precise_activations("auto", llama.parameters)
    for parameters in (smol.parameters, llama.parameters):  # a setting is kept as it is
        assert precise_activations("precise", parameters)
        assert not precise_activations("int8", parameters)


def test_the_head_timed_is_the_one_packed(smol_packed):
    """SmolLM2's tied embedding is its head; beside a float lm_head (untied) nothing is, as
    pack_model packs no untied embedding; a wrapper's nested lm_head counts as untied too."""
    import dataclasses

    import mlx.nn as nn

    from mlxd.models.cpu_path_timing import model_shapes
    from mlxd.models.estimate import headers
    from mlxd.models.packability import quantized_layers

    tied = headers(smol_packed.path)
    embedding = tied.tensors["model.embed_tokens.weight"]
    shapes = model_shapes(tied)
    assert shapes is not None and shapes.head is not None
    assert shapes.head[:2] == (embedding["shape"][0], 576)  # 49,152 tokens by SmolLM2's hidden
    float_head = {"dtype": "F32", "shape": [embedding["shape"][0], 576], "data_offsets": [0, 0]}
    untied = dataclasses.replace(tied, tensors={**tied.tensors, "lm_head.weight": float_head})
    untied_shapes = model_shapes(untied)
    assert untied_shapes is not None and untied_shapes.head is None
    assert untied_shapes.layer == shapes.layer

    class Language(nn.Module):
        def __init__(self, head: bool) -> None:
            super().__init__()
            self.embed_tokens = nn.QuantizedEmbedding(256, 64)
            self.proj = nn.QuantizedLinear(64, 64)
            if head:
                self.lm_head = nn.QuantizedLinear(64, 256)

    class Wrapper(nn.Module):
        def __init__(self, head: bool) -> None:
            super().__init__()
            self.language_model = Language(head)

    assert set(quantized_layers(Wrapper(head=True))) == {
        "language_model.proj",
        "language_model.lm_head",
    }
    assert "language_model.embed_tokens" in quantized_layers(Wrapper(head=False))


def test_time_paths_without_float32_times_the_packed_layouts_alone():
    from mlxd import kernels
    from mlxd.models.cpu_path_probe import ModelShapes
    from mlxd.models.cpu_path_timing import time_paths

    shapes = ModelShapes(layer=((64, 64, 32, 4),), head=(256, 64, 32, 8), layers=2)
    timings = time_paths(shapes, Phases(prefill=16), precise=False, float32=False)
    assert timings.float32 == () and timings.packed_shared == timings.packed
    assert len(timings.packed) == 4 and all(ms > 0 for ms in timings.packed)
    assert len(timings.packed_dot) == (4 if kernels.integer_dot() else 0)


def test_experts_are_timed_through_the_gather_each_row_routed_to_its_top_k(monkeypatch):
    """A stack of experts runs as the model runs it at each phase: every row of x through k
    distinct experts (not as one dense matrix of all of them), in each layout and, under the
    float32 plan, still packed (the loader keeps no float32 copy of experts)."""
    import mlx.core as mx
    import numpy as np

    from mlxd import kernels
    from mlxd.models import cpu_path_probe
    from mlxd.models.cpu_path_probe import ModelShapes

    if not kernels.available():
        pytest.fail("mlxd's CPU kernels did not build: python -m mlxd.kernels.build")
    gathers: list[tuple[int, np.ndarray, bool]] = []
    gather = kernels.gather_qmatmul

    def recorded(x: mx.array, indices: mx.array, experts: kernels.Packed) -> mx.array:
        assert experts.shape == (64, 96) and experts.weight.shape[0] == 8
        gathers.append((x.shape[0], np.array(indices), experts.dot))
        return gather(x, indices, experts)

    monkeypatch.setattr(kernels, "gather_qmatmul", recorded)
    passes: list[tuple[str, bool]] = []
    make_pass = cpu_path_probe._pass

    def spied(group: list, inputs: dict, layout: str):
        passes.append((layout, any(m.per_token for m in group)))
        return make_pass(group, inputs, layout)

    monkeypatch.setattr(cpu_path_probe, "_pass", spied)
    shapes = ModelShapes(
        layer=((64, 64, 32, 4),),
        head=None,
        layers=2,
        experts=((8, 64, 96, 32, 4),),
        experts_per_token=2,
    )
    # A prefill chunk over PREFILL_ROWS: a layer with experts is timed over all of it.
    prefill = cpu_path_probe.PREFILL_ROWS + 16
    timings = cpu_path_probe.time_paths(shapes, Phases(prefill=prefill))  # in this process
    assert len(timings.float32) == 4 and all(ms > 0 for ms in timings.float32)
    assert {layout for layout, experts in passes if experts} == (
        {"dot", "float", "float32"} if kernels.integer_dot() else {"float", "float32"}
    )
    assert {rows for rows, _, _ in gathers} == {1, 8, 32, prefill}
    for rows, routes, _ in gathers:
        assert routes.shape == (rows, 2) and routes.max() < 8
        assert all(len(set(row)) == 2 for row in routes.tolist())
    assert {dot for *_, dot in gathers} == ({False, True} if kernels.integer_dot() else {False})


def test_an_experts_top_k_unknown_routes_every_row_through_every_expert(monkeypatch):
    from mlxd import kernels
    from mlxd.models import cpu_path_probe
    from mlxd.models.cpu_path_probe import ModelShapes

    if not kernels.available():
        pytest.fail("mlxd's CPU kernels did not build: python -m mlxd.kernels.build")
    widths: list[int] = []
    gather = kernels.gather_qmatmul
    monkeypatch.setattr(
        kernels,
        "gather_qmatmul",
        lambda x, indices, experts: widths.append(indices.shape[1]) or gather(x, indices, experts),
    )
    shapes = ModelShapes(layer=(), head=None, layers=1, experts=((4, 32, 64, 32, 8),))
    cpu_path_probe.time_paths(shapes, Phases(prefill=16), float32=False)
    assert widths and set(widths) == {4}


@pytest.mark.parametrize(
    ("stack", "top_k", "timed"),
    [
        ((128, 768, 2048), 8, (128, 8)),  # Qwen3-30B-A3B: 100 MB, whole
        ((8, 14336, 4096), 2, (8, 2)),  # Mixtral 8x7B: 235 MB, whole
        ((128, 1536, 4096), 8, (80, 5)),  # Qwen3-235B-A22B: 403 MB, in slices of 16 and 1
        ((256, 2048, 7168), 8, (32, 1)),  # DeepSeek-V3: 1.9 GB, the fewest with a whole k
        ((256, 2048, 7168), 256, (36, 36)),  # its top k unknown: every expert of the slice
    ],
)
def test_a_large_stack_of_experts_is_timed_over_a_slice_with_its_share_of_routes(
    stack, top_k, timed
):
    from mlxd.models.cpu_path_probe import STACK_BYTES, _slice

    count, out, in_dims = stack
    experts, routes, scale = _slice(count, top_k, out * in_dims // 2)
    assert (experts, routes) == timed
    assert routes * count == top_k * experts  # each expert's share of the routes kept
    assert scale == count / experts
    assert experts == count or experts * out * in_dims // 2 <= STACK_BYTES


def test_a_stack_no_share_keeping_slice_fits_keeps_each_rows_top_k_among_fewer():
    """Llama 4 Scout: 16 experts of 8,192 x 5,120, top 1 (335 MB at 4 bits); a slice keeping
    each expert's share needs all 16. Twelve of them, each row through one: a row's work is
    the stack's, so the time is not scaled."""
    from mlxd.models.cpu_path_probe import STACK_BYTES, _slice

    expert_bytes = 8192 * 5120 // 2
    assert 16 * expert_bytes > STACK_BYTES
    assert _slice(16, 1, expert_bytes) == (12, 1, 1.0)
    assert _slice(16, 2, expert_bytes) == (8, 1, 2.0)  # top 2: a share-keeping slice of 8


def test_a_sliced_stack_is_timed_as_the_whole_stack(monkeypatch):
    """A slice of half the experts routed to half the top k counts twice: the step estimate is
    the dense matmuls' time plus twice the slice's."""
    from mlxd import kernels
    from mlxd.models import cpu_path_probe
    from mlxd.models.cpu_path_probe import ModelShapes

    if not kernels.available():
        pytest.fail("mlxd's CPU kernels did not build: python -m mlxd.kernels.build")
    monkeypatch.setattr(cpu_path_probe, "STACK_BYTES", 8 * 64 * 96 // 2)
    stack = cpu_path_probe._stack((16, 64, 96, 32, 4), 4, precise=True)
    assert stack.packed.weight.shape[0] == 8 and stack.per_token == 2 and stack.scale == 2.0
    # Every pass "takes" 1 ms: the dense matrix's counts once, the slice's twice.
    monkeypatch.setattr(cpu_path_probe, "_best_ms", lambda runs, *_: [1.0] * len(runs))
    shapes = ModelShapes(
        layer=((64, 64, 32, 4),),
        head=None,
        layers=3,
        experts=((16, 64, 96, 32, 4),),
        experts_per_token=4,
    )
    timings = cpu_path_probe.time_paths(shapes, Phases(prefill=16), float32=False)
    assert timings.packed == (9.0, 9.0, 9.0, 9.0)


def test_the_timing_child_reads_a_mixture_of_experts():
    from mlxd.models.cpu_path_probe import ModelShapes
    from mlxd.models.cpu_path_timing import time_paths

    shapes = ModelShapes(((64, 64, 32, 4),), (256, 64, 32, 8), 2, ((4, 64, 64, 32, 4),), 2)
    timings = time_paths(shapes, Phases(prefill=16))  # the child process, through JSON
    for figures in (timings.packed, timings.packed_shared, timings.float32):
        assert len(figures) == 4 and all(ms > 0 for ms in figures)


def _quantized(shape: list[int], bits: int = 4, group: int = 32) -> dict:
    """Safetensors header entries of a quantized matrix (or stack) of `shape` [.., out, in]."""
    *rows, inputs = shape
    entry = lambda dims: {"dtype": "U32", "shape": dims, "data_offsets": [0, 4]}  # noqa: E731
    return {
        "weight": entry([*rows, inputs * bits // 32]),
        "scales": entry([*rows, inputs // group]),
        "biases": entry([*rows, inputs // group]),
    }


def test_a_mixture_of_experts_is_timed_as_its_expert_layers_past_its_dense_ones():
    """DeepSeek's first_k_dense_replace, Qwen3-MoE's mlp_only_layers: a few dense layers
    first, then experts; each stack's packability is its experts' rows, not all of theirs."""
    from mlxd.models.cpu_path_timing import model_shapes
    from mlxd.models.estimate import Headers

    layers = {0: {"mlp.gate_proj": [128, 64], "mlp.up_proj": [128, 64], "mlp.down_proj": [64, 128]}}
    for index in (1, 2, 3):
        layers[index] = {
            "mlp.switch_mlp.gate_proj": [8, 96, 64],
            "mlp.switch_mlp.up_proj": [8, 96, 64],
            "mlp.switch_mlp.down_proj": [8, 64, 96],
            # 8 x 20 rows is a multiple of 32, 20 is not: the kernels do not take it.
            "mlp.odd.down_proj": [8, 20, 64],
        }
    tensors = {}
    for index, matmuls in layers.items():
        for part, shape in {"self_attn.q_proj": [64, 64], **matmuls}.items():
            for leaf, entry in _quantized(shape).items():
                tensors[f"model.layers.{index}.{part}.{leaf}"] = entry
    shapes = model_shapes(Headers(tensors, {"group_size": 32}, experts_per_token=2))
    assert shapes is not None and shapes.layers == 4
    assert shapes.layer == ((64, 64, 32, 4),)
    assert sorted(shapes.experts) == [(8, 64, 96, 32, 4), (8, 96, 64, 32, 4), (8, 96, 64, 32, 4)]
    assert shapes.experts_per_token == 2
    dense_only = {k: v for k, v in tensors.items() if "layers.0." in k}
    plain = model_shapes(Headers(dense_only, {"group_size": 32}, experts_per_token=2))
    assert plain is not None and plain.experts == () and plain.experts_per_token == 0


# A text model's config.json of the layer's shapes below (hidden 64, 4 heads of 16, 2 kv heads).
TEXT_CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": 128,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


def _config(model_type: str) -> dict:
    if model_type == "qwen2_vl":  # mlx-lm builds qwen2's model of its text_config
        return {"model_type": model_type, "text_config": {"model_type": "qwen2", **TEXT_CONFIG}}
    extra = {
        "gemma2": {"query_pre_attn_scalar": 16, "attn_logit_softcapping": 50.0},
        "smollm3": {"no_rope_layer_interval": 2},  # llama's model, some layers without RoPE
    }
    return {"model_type": model_type, **TEXT_CONFIG, **extra.get(model_type, {})}


@pytest.mark.parametrize(
    ("model_type", "v_bits", "timed"),
    [
        # KernelAttention's q, k and v as one matmul: 64 + 32 + 32 rows
        ("llama", 4, [(64, 64, 32, 4), (128, 64, 32, 4)]),
        ("mistral", 4, [(64, 64, 32, 4), (128, 64, 32, 4)]),  # mlx-lm runs it as llama
        ("qwen3", 4, [(64, 64, 32, 4), (128, 64, 32, 4)]),
        # llama's and qwen2's models under other types: the loader fuses theirs too
        ("smollm3", 4, [(64, 64, 32, 4), (128, 64, 32, 4)]),
        ("qwen2_vl", 4, [(64, 64, 32, 4), (128, 64, 32, 4)]),
        # mlx-lm's own attention runs them apart; so does the loader where v's width differs
        # (a Q4_K_M's v is Q6_K: 8 bits on the kernels)
        ("gemma2", 4, [(32, 64, 32, 4), (32, 64, 32, 4), (64, 64, 32, 4), (64, 64, 32, 4)]),
        ("llama", 8, [(32, 64, 32, 4), (32, 64, 32, 8), (64, 64, 32, 4), (64, 64, 32, 4)]),
    ],
)
def test_q_k_and_v_are_timed_as_one_matmul_where_the_model_runs_them_so(
    model_type: str, v_bits: int, timed: list
):
    from mlxd.models.cpu_path_timing import model_shapes
    from mlxd.models.estimate import Headers

    parts = {"q_proj": ([64, 64], 4), "k_proj": ([32, 64], 4), "v_proj": ([32, 64], v_bits)}
    parts["o_proj"] = ([64, 64], 4)
    tensors = {}
    for index in (0, 1):
        for part, (shape, bits) in parts.items():
            for leaf, entry in _quantized(shape, bits).items():
                tensors[f"model.layers.{index}.self_attn.{part}.{leaf}"] = entry
    shapes = model_shapes(Headers(tensors, {"group_size": 32}, config=_config(model_type)))
    assert shapes is not None and shapes.layers == 2
    assert sorted(shapes.layer) == timed
    # The float32 plan's layers (no fusion there) are timed as stored.
    stored = sorted((shape[0], 64, 32, bits) for shape, bits in parts.values())
    assert sorted(shapes.apart or shapes.layer) == stored


def test_q_k_and_v_of_one_kernel_width_fuse_whatever_their_stored_bits():
    """A Q5_K_M's q and k (Q5_K) and v (Q6_K) all run at 8 bits: the loader fuses them."""
    from mlxd.models.cpu_path_timing import model_shapes
    from mlxd.models.estimate import Headers

    tensors = {}
    for part, bits in {"q_proj": 5, "k_proj": 5, "v_proj": 6}.items():
        for leaf, entry in _quantized([64, 64], bits).items():
            tensors[f"model.layers.0.self_attn.{part}.{leaf}"] = entry
    shapes = model_shapes(Headers(tensors, {"group_size": 32}, config=_config("llama")))
    assert shapes is not None and shapes.layer == ((192, 64, 32, 8),)


def test_the_probe_times_a_layer_as_the_loader_runs_it(smol, tmp_path):
    """The packed matmuls of a loaded SmolLM2 layer (q, k and v fused, gate and up too) are the
    shapes the probe times: on a first load, which packs, and on the next, from the packed
    file."""
    from mlxd.models.cpu_path_timing import model_shapes
    from mlxd.models.loader import load_llm
    from mlxd.models.packed import PackedLinear
    from mlxd.models.packed_cache import wait_for_writes

    def layer_shapes(loaded) -> list[tuple[int, int]]:
        return sorted(
            tuple(module.packed.shape)
            for _, module in loaded.model.layers[0].named_modules()
            if isinstance(module, PackedLinear)
        )

    shapes = model_shapes(smol.path)
    assert shapes is not None
    timed = sorted((out, inputs) for out, inputs, *_ in shapes.layer)
    first = load_llm(smol.path, dtype="auto", model_name="smol", cache_dir=tmp_path)
    wait_for_writes()  # the packed file, written beside the first load
    assert (2 * 1536, 576) in timed and layer_shapes(first) == timed
    cached = load_llm(smol.path, dtype="auto", model_name="smol", cache_dir=tmp_path)
    assert layer_shapes(cached) == timed


def test_the_float32_pass_times_the_layer_apart_and_the_packed_passes_fused(monkeypatch):
    from mlxd import kernels
    from mlxd.models import cpu_path_probe
    from mlxd.models.cpu_path_probe import ModelShapes

    if not kernels.available():
        pytest.fail("mlxd's CPU kernels did not build: python -m mlxd.kernels.build")
    passes: dict[str, set[tuple[int, ...]]] = {}
    make_pass = cpu_path_probe._pass

    def spied(group: list, inputs: dict, layout: str):
        if group[0].packed.shape[1] == 64:  # the layer, not the head
            passes.setdefault(layout, set()).add(tuple(sorted(m.packed.shape[0] for m in group)))
        return make_pass(group, inputs, layout)

    monkeypatch.setattr(cpu_path_probe, "_pass", spied)
    shapes = ModelShapes(
        layer=((64, 64, 32, 4), (128, 64, 32, 4)),
        head=None,
        layers=1,
        apart=((32, 64, 32, 4), (32, 64, 32, 4), (64, 64, 32, 4), (64, 64, 32, 4)),
    )
    cpu_path_probe.time_paths(shapes, Phases(prefill=16))
    assert passes.pop("float32") == {(32, 32, 64, 64)}
    assert passes and all(shapes == {(64, 128)} for shapes in passes.values())


def test_a_model_is_timed_once_then_served_from_the_cache(smol_packed, tmp_path, monkeypatch):
    from mlxd.config import ModelConfig, ServerConfig
    from mlxd.models import cpu_path_timing

    shapes = cpu_path_timing.model_shapes(smol_packed.path)
    assert shapes is not None and shapes.layers == 30
    assert shapes.head == (49_152, 576, 32, 8)  # the tied 8-bit embedding
    # q, k and v as one matmul (576 + 192 + 192 rows), as KernelAttention runs them; gate and
    # up as another (1536 + 1536), as RationalSwiGLU does
    assert sorted(shapes.layer) == [
        (576, 576, 32, 4), (576, 1536, 32, 4), (960, 576, 32, 4), (3072, 576, 32, 4)
    ]  # fmt: skip
    timed = []

    def fake(shapes, phases, precise, float32):
        timed.append(phases)
        return EPYC

    monkeypatch.setattr(cpu_path_timing, "time_paths", fake)
    monkeypatch.setattr(cpu_path_timing, "_timed", {})
    monkeypatch.setattr(cpu_path_timing, "machine_busy", lambda: False)
    monkeypatch.setattr(cpu_path_timing, "pace_ms", lambda: 1.0)
    config = ModelConfig(kind="llm", source=str(smol_packed.path))
    server = ServerConfig(cache_dir=tmp_path)
    first = cpu_path_timing.choose_cpu_path(smol_packed.path, config, server)
    assert first is not None and first.plan == "float32" and not first.cached
    assert timed == [Phases(prefill=config.batch.prefill_step_size)]
    monkeypatch.setattr(cpu_path_timing, "_timed", {})  # a new worker process: the disk
    second = cpu_path_timing.choose_cpu_path(smol_packed.path, config, server)
    assert second is not None and second.cached and second.plan == "float32"
    assert len(timed) == 1

    tight = ServerConfig(cache_dir=tmp_path / "other", memory_budget=300 * 2**20)
    choice = cpu_path_timing.choose_cpu_path(smol_packed.path, config, tight)
    assert choice is not None and choice.plan == "packed" and choice.timings is None
    assert len(timed) == 1  # float32 does not fit: nothing timed
    assert choice.weight_bytes < 300 * 2**20


def test_timings_taken_on_a_busy_machine_are_used_but_not_cached(
    smol_packed, tmp_path, monkeypatch
):
    from mlxd.config import ModelConfig, ServerConfig
    from mlxd.models import cpu_path_timing

    timed = []
    monkeypatch.setattr(cpu_path_timing, "time_paths", lambda s, p, *_: timed.append(p) or EPYC)
    monkeypatch.setattr(cpu_path_timing, "machine_busy", lambda: True)
    monkeypatch.setattr(cpu_path_timing, "pace_ms", lambda: 1.0)
    config = ModelConfig(kind="llm", source=str(smol_packed.path))
    server = ServerConfig(cache_dir=tmp_path)
    for _ in range(2):  # two worker processes, one after the other
        monkeypatch.setattr(cpu_path_timing, "_timed", {})
        choice = cpu_path_timing.choose_cpu_path(smol_packed.path, config, server)
        assert choice is not None and choice.plan == "float32" and not choice.cached
    assert len(timed) == 2 and not list(tmp_path.rglob("*.json"))


def loads_at(model, monkeypatch, tmp_path, *paces: float) -> tuple[list[Choice], list[int]]:
    """Loads of `model` in successive worker processes, the machine's pace in ms measured
    as `paces` go (a load measures once, and again after it times); the fake timings are
    EPYC's with decode at one row slowed by the pace (how a slow spell shows)."""
    from mlxd.config import ModelConfig, ServerConfig
    from mlxd.models import cpu_path_timing

    pace = iter(paces)
    now = [0.0]
    timed: list[int] = []

    def measured() -> float:
        now[0] = next(pace)
        return now[0]

    def fake(*_):
        timed.append(len(timed))
        return Timings(**{**EPYC.__dict__, "packed": (8.0 * now[0], *EPYC.packed[1:])})

    monkeypatch.setattr(cpu_path_timing, "time_paths", fake)
    monkeypatch.setattr(cpu_path_timing, "machine_busy", lambda: False)
    monkeypatch.setattr(cpu_path_timing, "pace_ms", measured)
    config = ModelConfig(kind="llm", source=str(model.path))
    server = ServerConfig(cache_dir=tmp_path)
    choices = []
    while True:
        monkeypatch.setattr(cpu_path_timing, "_timed", {})  # a new worker process
        try:
            choice = cpu_path_timing.choose_cpu_path(model.path, config, server)
        except StopIteration:
            return choices, timed
        assert choice is not None
        choices.append(choice)


def cached_pace(tmp_path) -> list[float]:
    return [json.loads(f.read_text())["pace_ms"] for f in tmp_path.rglob("cpu-paths/*.json")]


def test_timings_taken_at_a_slower_pace_than_now_are_timed_again(
    smol_packed, monkeypatch, tmp_path
):
    # Timed in a slow spell (pace 2.0 ms), then loaded at 1.0: timed again and replaced.
    choices, timed = loads_at(smol_packed, monkeypatch, tmp_path, 2.0, 2.0, 1.0, 1.0, 1.0)
    first, second, third = choices
    assert not first.cached and first.kept and first.timing_note == ""
    assert not second.cached and second.kept and len(timed) == 2
    note = "timed again: the cached timings were taken at 2.0x this load's pace"
    assert second.timing_note == note and note in second.summary()
    assert second.timings is not None and second.timings.packed[0] == 8.0
    assert third.cached and third.timings == second.timings and len(timed) == 2
    assert cached_pace(tmp_path) == [1.0]


def test_timings_are_read_at_a_pace_within_the_margin_or_slower(smol_packed, monkeypatch, tmp_path):
    # 1.25x faster than when timed is within the margin; a slower machine keeps them too.
    choices, timed = loads_at(smol_packed, monkeypatch, tmp_path, 1.0, 1.0, 0.8, 3.0)
    assert [c.cached for c in choices] == [False, True, True] and len(timed) == 1
    assert all(c.timing_note == "" for c in choices)


def test_timings_taken_while_the_pace_moved_are_used_not_kept(smol_packed, monkeypatch, tmp_path):
    choices, timed = loads_at(smol_packed, monkeypatch, tmp_path, 1.0, 1.5, 1.0, 1.0)
    first, second = choices
    assert not first.kept and not first.cached and first.plan == "float32"
    assert first.timing_note == "the machine's pace moved 1.5x while timing, not cached"
    assert first.as_dict()["kept"] is False and first.as_dict()["timing_note"] in first.summary()
    assert second.kept and not second.cached and len(timed) == 2  # the next load times again
    assert cached_pace(tmp_path) == [1.0]


def test_timings_kept_before_the_pace_was_are_trusted(tmp_path):
    from mlxd.models import cpu_path_timing

    cache = TimingCache(tmp_path)
    key = TimingCache.key(identity())
    cache.root.mkdir(parents=True)
    record = {"identity": identity(), "timings": EPYC.__dict__}  # an older mlxd's record
    (cache.root / f"{key}.json").write_text(json.dumps(record))
    assert cache.get(key) == Record(EPYC, None)
    timed = cpu_path_timing.timed_or_cached(cache, key, identity(), lambda: pytest.fail())
    assert timed.cached and timed.kept and timed.timings == EPYC


def test_the_pace_is_a_positive_figure_in_ms():
    from mlxd.models.cpu_path_cache import pace_ms

    paces = [pace_ms() for _ in range(2)]
    assert all(0 < p < 10_000 and math.isfinite(p) for p in paces)


def test_busy_means_other_work_holds_every_core_now(monkeypatch):
    from mlxd.models import cpu_path_timing

    cores = len(os.sched_getaffinity(0))
    for others, busy in ((0, False), (cores - 1, False), (cores, True)):
        monkeypatch.setattr(cpu_path_timing, "runnable_tasks", lambda n=others: n + 1)
        assert cpu_path_timing.machine_busy() is busy
    # Not the minute's average: it lags behind a heavy job that has ended.
    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    monkeypatch.setattr(cpu_path_timing, "runnable_tasks", lambda: 1)
    assert not cpu_path_timing.machine_busy()


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux's /proc/stat")
def test_runnable_tasks_count_the_caller():
    from mlxd.models import cpu_path_timing

    assert (cpu_path_timing.runnable_tasks() or 0) >= 1


def test_the_key_names_the_kernel_build_and_the_isa_it_runs(monkeypatch):
    from mlxd import kernels
    from mlxd.models import cpu_path_timing
    from mlxd.models.cpu_path_probe import ModelShapes

    shapes = ModelShapes(layer=((64, 64, 32, 4),), head=None, layers=1)
    ident = cpu_path_timing.identity(shapes, PHASES)
    assert ident["isa"] == kernels.isa() and len(ident["kernels"]) == 16
    # A dense model's shapes as they were keyed before experts were: its timings stay valid.
    assert ident["shapes"] == [[(64, 64, 32, 4)], None, 1]
    moe = ModelShapes(shapes.layer, None, 1, experts=((8, 64, 64, 32, 4),), experts_per_token=2)
    assert cpu_path_timing.identity(moe, PHASES)["shapes"][3:] == [[(8, 64, 64, 32, 4)], 2]
    # Another ISA than the one running (e.g. MLXD_KERNELS_ISA=generic; avx2 where that is it).
    other = "avx2" if kernels.isa() == "generic" else "generic"
    monkeypatch.setattr(kernels, "isa", lambda: other)
    forced = cpu_path_timing.identity(shapes, PHASES)
    assert TimingCache.key(forced) != TimingCache.key(ident)
    one_term = cpu_path_timing.identity(shapes, PHASES, precise=False)
    assert TimingCache.key(one_term) != TimingCache.key(forced)


def test_a_small_models_one_row_kernels_leave_a_core_to_the_engine() -> None:
    """A one-row step estimated under SMALL_STEP_MS (SmolLM2's, not a 1B's) on every core:
    one-row kernels run on a thread fewer, so the engine's Python keeps a core."""
    small = Timings((5.0, 6.0, 8.0, 100.0), (6.0, 8.0, 12.0, 150.0), (9.0, 15.0, 30.0, 200.0))
    choice = choose(small)
    assert choice.plan == "packed" and choice.spares_a_core
    assert "one-row kernels leave a core to the engine" in choice.summary()
    assert choice.as_dict()["spares_a_core"] is True
    large = Timings(
        (20.0, 72.0, 220.0, 1265.0), (30.0, 130.0, 400.0, 2300.0), (230.0, 440.0, 520.0, 2270.0)
    )
    assert choose(large).plan == "packed" and not choose(large).spares_a_core
    # One thread already (a busy machine), or mixed with BLAS: nothing to leave.
    busy = Timings((5.0, 6.0, 8.0, 100.0), (3.0, 4.0, 6.0, 80.0), (9.0, 15.0, 30.0, 200.0))
    assert choose(busy).one_thread and not choose(busy).spares_a_core
    split = Timings((4.0, 6.0, 9.0, 900.0), (5.0, 7.0, 11.0, 950.0), (9.0, 15.0, 30.0, 200.0))
    assert choose(split).plan == "mixed" and not choose(split).spares_a_core


def test_the_load_applies_the_spare_core_to_one_row_kernels(smol) -> None:
    """A worker loading a small model on its plan (decided here on fake timings): one-row
    kernels on a thread fewer, larger ones on every thread; a large model's on every thread.
    The int8 layout's buffered passes from the rows its plan says.
    In a process of its own: a float32 model, as the `smol` fixture, pins the kernels to one
    thread for the rest of the process."""
    import subprocess
    import sys

    script = f"""
from pathlib import Path
from mlxd import kernels
from mlxd.models.cpu_path import Phases, Timings, decide
from mlxd.models.loader import load_llm

def load(decode_ms, dot_ms=()):
    timings = Timings(decode_ms, decode_ms, (5000.0,) * 4, dot_ms)
    choice = decide(Phases(prefill=256), timings, packed_bytes=1, float32_bytes=2, kv_bytes=0,
                    budget=10)
    load_llm(Path({str(smol.path)!r}), model_name="smol", cpu_path=choice)
    return kernels.threads_for_rows(1), kernels.threads_for_rows(8)

kernels.set_threads(2)
print(load((3.0, 6.0, 9.0, 90.0)), load((20.0, 70.0, 220.0, 1200.0)))
# The int8 layout, buffered from 32 rows (and the next load's plan without: none).
load((3.0, 6.0, 9.0, 90.0), (2.0, 6.0, 10.0, 100.0))
buffered = kernels.dot_buffer_rows()
load((3.0, 6.0, 9.0, 90.0))
print(buffered, kernels.dot_buffer_rows())
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    spare, dot = result.stdout.strip().splitlines()
    assert dot == "32 0", result.stdout
    small, large = spare.split(") (")
    cores = min(2, len(__import__("os").sched_getaffinity(0)))
    if cores > 1:
        assert small == "(1, 2" and large == "2, 2)", result.stdout
    else:
        assert small == "(1, 1" and large == "1, 1)", result.stdout


def test_the_timing_child_imports_the_kernels_not_the_worker():
    """The child of a first load: the worker's modules and mlx-lm's (≈1 s) stay out of it."""
    import subprocess
    import sys

    heavy = "{'mlx_lm', 'transformers', 'mlxd.worker'}"
    code = f"import sys, mlxd.models.cpu_path_probe; print(sorted({heavy} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_failed_timing_says_why():
    from mlxd.models.cpu_path_probe import ModelShapes
    from mlxd.models.cpu_path_timing import time_paths

    shapes = ModelShapes(layer=((64, 64, 32, 7),), head=None, layers=1)  # no kernel width
    with pytest.raises(RuntimeError, match=r"timing the CPU paths failed .*KeyError: 7"):
        time_paths(shapes, Phases(prefill=16))
