"""The CPU path decision (models/cpu_path.py) with faked timings, and its timing cache."""

from __future__ import annotations

import pytest

from mlxd.models.cpu_path import Choice, Phases, TimingCache, Timings, decide

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
        "isa": "avx2",
        "shapes": [[576, 1536, 32, 4]],
        "phases": [1, 8, 32, 512],
    }
    return base | changes


def test_timings_are_cached_by_cpu_kernel_build_and_shapes(tmp_path):
    cache = TimingCache(tmp_path)
    key = TimingCache.key(identity())
    assert cache.get(key) is None
    cache.put(key, identity(), EPYC)
    assert TimingCache(tmp_path).get(TimingCache.key(identity())) == EPYC  # a second load
    for changed in (
        identity(kernels="def456"),  # a rebuilt kernel module
        identity(isa="avx512"),
        identity(cpu="Intel Xeon"),
        identity(shapes=[[2048, 8192, 64, 4]]),
        identity(phases=[1, 8, 32, 2048]),
    ):
        assert cache.get(TimingCache.key(changed)) is None


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
