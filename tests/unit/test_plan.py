"""Reconcile planning: which actions turn the running models into the configured ones."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import pytest

from mlxd.config import (
    AudioConfig,
    BatchConfig,
    CacheConfig,
    Config,
    DistributedConfig,
    ModelConfig,
    ParsersConfig,
    SamplingDefaults,
    SpeculativeConfig,
)
from mlxd.control.plan import (
    ENGINE_FIELDS,
    ROUTING_FIELDS,
    Action,
    Actual,
    Load,
    Park,
    Rename,
    Resident,
    Resize,
    Restart,
    Retarget,
    State,
    Swap,
    Unload,
    backoff,
    describe,
    engine_settings,
    evictions,
    plan,
)


def cfg(source: str = "a", **overrides: Any) -> ModelConfig:
    return ModelConfig(source=f"hf://org/{source}", **overrides)


def loaded(config: ModelConfig) -> Actual:
    return Actual(config, "loaded")


# One changed value per field, each different from cfg()'s default.
ENGINE_CHANGES: dict[str, Any] = {
    "kind": "vlm",
    "source": "b",
    "adapter": "/adapters/fr",
    "dtype": "float16",
    "cpu_activations": "int8",
    "batch": BatchConfig(max_batch_size=4),
    "cache": CacheConfig(kv_bits=8),
    "context_length": 4096,
    "max_prompt_tokens": 1024,
    "distributed": DistributedConfig(hosts=["127.0.0.1"] * 3),
    "speculative": SpeculativeConfig(num_tokens=2),
    "audio": AudioConfig(voice="expr-voice-2-f"),
}
ROUTING_CHANGES: dict[str, Any] = {
    "aliases": ["x"],
    "api_keys": ["secret"],
    "defaults": SamplingDefaults(temperature=0.1),
    "parsers": ParsersConfig(tool_calls="hermes"),
    "load": "lazy",
    "idle_ttl": 60.0,
    "truncate": False,
    "max_inputs": 16,
    "chat_template_kwargs": {"enable_thinking": False},
    "rate_limit": {"requests_per_minute": 5},
    "stream_interval": 4,
    "warm_up": True,
}


def test_fields_partition_the_schema() -> None:
    # A new ModelConfig field must be classified, and every field is exercised below.
    assert set(ENGINE_FIELDS).isdisjoint(ROUTING_FIELDS)
    assert set(ENGINE_FIELDS) | set(ROUTING_FIELDS) == set(ModelConfig.model_fields)
    assert set(ENGINE_CHANGES) == set(ENGINE_FIELDS)
    assert set(ROUTING_CHANGES) == set(ROUTING_FIELDS)


def test_engine_settings_ignore_routing_fields() -> None:
    assert engine_settings(cfg()) == engine_settings(cfg(**ROUTING_CHANGES))
    assert engine_settings(cfg()) != engine_settings(cfg(dtype="float16"))


@pytest.mark.parametrize(
    ("desired", "actual", "expected"),
    [
        pytest.param({}, {}, [], id="empty"),
        pytest.param({"m": cfg()}, {}, [Load("m", cfg())], id="add-eager"),
        pytest.param({"m": cfg(load="lazy")}, {}, [Load("m", cfg(load="lazy"))], id="add-lazy"),
        pytest.param({}, {"m": loaded(cfg())}, [Unload("m")], id="remove"),
        pytest.param({"m": cfg()}, {"m": loaded(cfg())}, [], id="unchanged"),
        pytest.param(
            {"m": cfg(kind="embedding")},
            {"m": loaded(cfg())},
            [Swap("m", cfg(kind="embedding"))],
            id="kind-change",
        ),
        pytest.param(
            {"m": cfg(batch=BatchConfig(max_queue=8), aliases=["x"])},
            {"m": loaded(cfg())},
            [
                Retarget("m", cfg(batch=BatchConfig(max_queue=8), aliases=["x"])),
                Swap("m", cfg(batch=BatchConfig(max_queue=8), aliases=["x"])),
            ],
            id="swap-and-alias",
        ),
        pytest.param(
            {"b": cfg(aliases=["x"])},
            {"a": loaded(cfg())},
            [Rename("a", "b", cfg(aliases=["x"]))],
            id="rename",
        ),
        pytest.param(
            {"b": cfg(), "c": cfg()},
            {"a": loaded(cfg())},
            [Rename("a", "b", cfg()), Load("c", cfg())],
            id="rename-first-match-only",
        ),
        pytest.param(
            {"c": cfg("c"), "d": cfg("a"), "e": cfg("b")},
            {"a": loaded(cfg("a")), "b": loaded(cfg("b"))},
            [Rename("a", "d", cfg("a")), Rename("b", "e", cfg("b")), Load("c", cfg("c"))],
            id="renames-pair-by-settings",
        ),
        pytest.param(
            {"a": cfg("a"), "b": cfg("b", aliases=["x"])},
            {"a": loaded(cfg("a", aliases=["x"])), "b": loaded(cfg("b"))},
            [Retarget("a", cfg("a")), Retarget("b", cfg("b", aliases=["x"]))],
            id="alias-moves",
        ),
        pytest.param(
            {"m": cfg()}, {"m": Actual(cfg(), "failed")}, [Load("m", cfg())], id="failed-retry"
        ),
        pytest.param(
            {"m": cfg("b")},
            {"m": Actual(cfg(), "failed")},
            [Load("m", cfg("b"))],
            id="failed-changed",
        ),
        pytest.param(
            {"m": cfg(load="lazy")},
            {"m": Actual(cfg(load="lazy"), "unloaded")},
            [],
            id="unloaded-unchanged",
        ),
        pytest.param(
            {"m": cfg("b", load="lazy")},
            {"m": Actual(cfg(load="lazy"), "unloaded")},
            [Retarget("m", cfg("b", load="lazy"))],
            id="unloaded-engine-change",
        ),
        pytest.param(
            {"m": cfg(load="lazy", aliases=["x"])},
            {"m": Actual(cfg(load="lazy"), "unloaded")},
            [Retarget("m", cfg(load="lazy", aliases=["x"]))],
            id="unloaded-routing-change",
        ),
        pytest.param(
            {"m": cfg()},
            {"m": Actual(cfg(load="lazy"), "unloaded")},
            [Load("m", cfg())],
            id="unloaded-to-eager",
        ),
        pytest.param({"m": cfg()}, {"m": Actual(cfg(), "parked")}, [], id="parked-eager-stays"),
        pytest.param(
            {"m": cfg(aliases=["x"])},
            {"m": Actual(cfg(), "parked")},
            [Retarget("m", cfg(aliases=["x"]))],
            id="parked-routing-change",
        ),
        pytest.param(
            {"m": cfg("b")},
            {"m": Actual(cfg(), "loading")},
            [Swap("m", cfg("b"))],
            id="loading-engine-change",
        ),
        pytest.param({"m": cfg()}, {"m": Actual(cfg(), "loading")}, [], id="loading-unchanged"),
        pytest.param(
            {"m": cfg(cache=CacheConfig(ram=2**20, ssd=2**30, ssd_ttl=60.0))},
            {"m": loaded(cfg())},
            [Resize("m", cfg(cache=CacheConfig(ram=2**20, ssd=2**30, ssd_ttl=60.0)))],
            id="cache-budgets-resize-in-place",
        ),
        pytest.param(
            {"m": cfg(cache=CacheConfig(ram=2**20), aliases=["x"])},
            {"m": loaded(cfg())},
            [
                Retarget("m", cfg(cache=CacheConfig(ram=2**20), aliases=["x"])),
                Resize("m", cfg(cache=CacheConfig(ram=2**20), aliases=["x"])),
            ],
            id="resize-and-alias",
        ),
        pytest.param(
            {"m": cfg(cache=CacheConfig(ram=2**20, block_size=32))},
            {"m": loaded(cfg())},
            [Swap("m", cfg(cache=CacheConfig(ram=2**20, block_size=32)))],
            id="cache-layout-swaps",
        ),
        pytest.param(
            {"m": cfg(cache=CacheConfig(ram=2**20), dtype="float16")},
            {"m": loaded(cfg())},
            [Swap("m", cfg(cache=CacheConfig(ram=2**20), dtype="float16"))],
            id="cache-and-weights-swap",
        ),
        pytest.param(
            {"m": cfg(cache=CacheConfig(ram=2**20))},
            {"m": Actual(cfg(), "loading")},
            [Swap("m", cfg(cache=CacheConfig(ram=2**20)))],
            id="loading-cache-change-reloads",
        ),
    ],
)
def test_plan(
    desired: dict[str, ModelConfig], actual: dict[str, Actual], expected: list[Action]
) -> None:
    assert plan(desired, actual) == expected


@pytest.mark.parametrize(("field", "value"), ENGINE_CHANGES.items(), ids=list(ENGINE_CHANGES))
def test_engine_field_change_swaps(field: str, value: Any) -> None:
    new = cfg(**{field: value})
    assert plan({"m": new}, {"m": loaded(cfg())}) == [Swap("m", new)]


@pytest.mark.parametrize(("field", "value"), ROUTING_CHANGES.items(), ids=list(ROUTING_CHANGES))
def test_routing_field_change_retargets(field: str, value: Any) -> None:
    new = cfg(**{field: value})
    assert plan({"m": new}, {"m": loaded(cfg())}) == [Retarget("m", new)]


@pytest.mark.parametrize("state", ["failed", "loading", "unloaded"])
def test_rename_of_unloaded_engine_reloads(state: State) -> None:
    assert plan({"b": cfg()}, {"a": Actual(cfg(), state)}) == [Unload("a"), Load("b", cfg())]


def test_every_kind_at_once_in_order() -> None:
    actual = {
        "gone": loaded(cfg("gone")),
        "old": loaded(cfg("moved")),
        "grow": loaded(cfg("grow")),
        "tweak": loaded(cfg("tweak")),
        "broken": Actual(cfg("broken"), "failed"),
        "also-gone": Actual(cfg("also-gone"), "loading"),
    }
    desired = {
        "fresh": cfg("fresh"),
        "broken": cfg("broken"),
        "tweak": cfg("tweak", idle_ttl=5.0),
        "grow": cfg("grow", context_length=8192, aliases=["big"]),
        "new": cfg("moved"),
    }
    assert plan(desired, actual) == [
        Unload("gone"),
        Unload("also-gone"),
        Rename("old", "new", desired["new"]),
        Retarget("tweak", desired["tweak"]),
        Retarget("grow", desired["grow"]),
        Swap("grow", desired["grow"]),
        Load("fresh", desired["fresh"]),
        Load("broken", desired["broken"]),
    ]


def test_plan_accepts_a_registry_s_models() -> None:
    config = Config(models={"m": cfg()})
    assert plan(config.models, {"m": loaded(cfg())}) == []


def test_a_new_draft_source_swaps_the_model_it_drafts_for() -> None:
    drafting = SpeculativeConfig(mode="draft", model="small")

    def models(draft: str) -> Mapping[str, ModelConfig]:
        return Config(models={"small": cfg(draft), "big": cfg(speculative=drafting)}).models

    actual = {name: loaded(config) for name, config in models("small").items()}
    assert plan(models("small"), actual) == []
    new = models("smaller")
    assert plan(new, actual) == [Swap("small", new["small"]), Swap("big", new["big"])]


# describe()


@pytest.mark.parametrize(
    "action",
    [
        Load("m", cfg()),
        Unload("m"),
        Swap("m", cfg()),
        Retarget("m", cfg()),
        Resize("m", cfg()),
        Rename("old", "m", cfg()),
    ],
    ids=lambda action: type(action).__name__,
)
def test_describe_names_the_model(action: Action) -> None:
    line = describe(action)
    assert "'m'" in line
    assert "\n" not in line


def describe_one(desired: ModelConfig, actual: Actual) -> list[str]:
    return [describe(action) for action in plan({"m": desired}, {"m": actual})]


def test_describe_lines() -> None:
    assert describe(Load("m", cfg(load="lazy"))) == "load 'm' (lazy)"
    assert describe(Load("m", cfg())) == "load 'm' (eager)"
    assert describe(Unload("m")) == "unload 'm'"
    assert describe(Rename("a", "b", cfg())) == "rename 'a' -> 'b'"
    assert describe_one(cfg(cache=CacheConfig(ssd=2**30)), loaded(cfg())) == [
        "resize 'm': cache.ssd 0 -> 1073741824"
    ]
    assert describe_one(cfg(aliases=["a", "b"]), loaded(cfg(aliases=["a"]))) == [
        "retarget 'm': aliases [a] -> [a, b]"
    ]
    assert describe_one(
        cfg(batch=BatchConfig(max_batch_size=16), idle_ttl=60.0, load="lazy"), loaded(cfg())
    ) == [
        "retarget 'm': load eager -> lazy; idle_ttl null -> 60.0",
        "swap 'm': batch.max_batch_size 32 -> 16",
    ]
    # A lazy model without an engine lists engine changes too: its next load uses them.
    assert describe_one(cfg("b", load="lazy"), Actual(cfg(load="lazy"), "unloaded")) == [
        "retarget 'm': source hf://org/a -> hf://org/b"
    ]


def test_describe_hides_api_keys() -> None:
    [line] = describe_one(cfg(api_keys=["new-secret"]), loaded(cfg(api_keys=["old-secret"])))
    assert line == "retarget 'm': api_keys changed"


# Property: carrying out a plan reaches the desired state, after which there is nothing to do.

_RANK = {Unload: 0, Rename: 1, Retarget: 2, Resize: 3, Swap: 4, Load: 5}


def simulate(actions: list[Action], actual: Mapping[str, Actual]) -> dict[str, Actual]:
    """What the daemon ends up running once every action is done and every load succeeded."""
    result = dict(actual)
    for action in actions:
        match action:
            case Unload(name):
                del result[name]
            case Rename(old, new, config):
                assert new not in result
                assert result.pop(old).state == "loaded"
                result[new] = Actual(config, "loaded")
            case Retarget(name, config) | Resize(name, config):
                result[name] = Actual(config, result[name].state)
            case Swap(name, config):
                assert result[name].state in ("loaded", "loading")
                result[name] = Actual(config, "loaded")
            case Load(name, config):
                result[name] = Actual(config, "loaded" if config.load == "eager" else "unloaded")
    return result


def random_config(rng: random.Random) -> ModelConfig:
    # Few choices per field, so renames, no-ops and mixed changes all turn up often.
    return cfg(
        rng.choice("ab"),
        dtype=rng.choice(["auto", "float16"]),
        cache=rng.choice([CacheConfig(), CacheConfig(ram=2**20), CacheConfig(kv_bits=8)]),
        aliases=rng.choice([[], ["x"], ["y"]]),
        load=rng.choice(["eager", "lazy"]),
    )


def random_actual(rng: random.Random, config: ModelConfig) -> Actual:
    if config.load == "lazy" and rng.random() < 0.5:
        return Actual(config, "unloaded")
    return Actual(config, rng.choice(["loaded", "loading", "failed"]))


@pytest.mark.parametrize("seed", range(200))
def test_plan_reaches_desired(seed: int) -> None:
    rng = random.Random(seed)
    names = [f"m{i}" for i in range(6)]
    actual = {name: random_actual(rng, random_config(rng)) for name in rng.sample(names, 4)}
    desired = {name: random_config(rng) for name in rng.sample(names, 4)}

    actions = plan(desired, actual)
    after = simulate(actions, actual)

    assert {name: state.config for name, state in after.items()} == desired
    assert plan(desired, after) == []
    ranks = [_RANK[type(action)] for action in actions]
    assert ranks == sorted(ranks)


# -- lifecycle facts: deaths, backoff, idleness, the memory budget ----------------------------


def test_a_dead_worker_restarts_once_its_backoff_has_run_out():
    waiting = {"m": Actual(cfg(), "dead", retry_in=1.5)}
    assert plan({"m": cfg()}, waiting) == []
    assert plan({"m": cfg()}, {"m": Actual(cfg(), "dead", retry_in=0.0)}) == [Restart("m", cfg())]


def test_a_dead_worker_takes_a_config_change_with_its_restart():
    actions = plan({"m": cfg(aliases=["x"])}, {"m": Actual(cfg(), "dead", retry_in=-1)})
    assert actions == [Retarget("m", cfg(aliases=["x"])), Restart("m", cfg(aliases=["x"]))]


def test_a_removed_dead_model_is_unloaded_not_restarted():
    assert plan({}, {"m": Actual(cfg(), "dead", retry_in=-1)}) == [Unload("m")]


def test_a_failed_load_is_retried_only_after_its_backoff():
    assert plan({"m": cfg()}, {"m": Actual(cfg(), "failed", retry_in=3.0)}) == []
    assert plan({"m": cfg()}, {"m": Actual(cfg(), "failed", retry_in=0.0)}) == [Load("m", cfg())]


@pytest.mark.parametrize(
    ("failures", "seconds"), [(1, 1.0), (2, 2.0), (3, 4.0), (6, 32.0), (7, 60.0), (50, 60.0)]
)
def test_backoff_doubles_up_to_a_minute(failures: int, seconds: float):
    assert backoff(failures) == seconds


def test_an_engine_idle_past_its_ttl_is_parked():
    idle = Actual(cfg(idle_ttl=30.0), "loaded", idle_for=31.0, idle_ttl=30.0)
    assert plan({"m": cfg(idle_ttl=30.0)}, {"m": idle}) == [Park("m")]


@pytest.mark.parametrize(
    "actual",
    [
        Actual(cfg(), "loaded", idle_for=29.0, idle_ttl=30.0),  # not yet
        Actual(cfg(), "loaded", idle_for=None, idle_ttl=30.0),  # busy
        Actual(cfg(), "loaded", idle_for=9e9, idle_ttl=None),  # no ttl (or keep_alive -1)
    ],
    ids=["young", "busy", "no-ttl"],
)
def test_an_engine_in_use_or_without_ttl_stays(actual: Actual):
    assert plan({"m": cfg()}, {"m": actual}) == []


def test_an_idle_engine_parks_and_keeps_its_new_settings_for_the_next_load():
    idle = Actual(cfg(), "loaded", idle_for=31.0, idle_ttl=30.0)
    assert plan({"m": cfg("b")}, {"m": idle}) == [Park("m"), Retarget("m", cfg("b"))]


def test_parks_come_before_loads():
    actual = {"old": Actual(cfg(), "loaded", idle_for=99.0, idle_ttl=1.0)}
    assert plan({"old": cfg(), "new": cfg("b")}, actual) == [Park("old"), Load("new", cfg("b"))]


def resident(name: str, size: int, last_used: float, idle: bool = True) -> Resident:
    return Resident(name, size, last_used, idle)


def test_evictions_take_idle_engines_least_recently_used_first():
    residents = [resident("a", 4, 3.0), resident("b", 4, 1.0), resident("c", 4, 2.0)]
    assert evictions(need=4, budget=12, residents=residents) == ["b"]
    assert evictions(need=8, budget=12, residents=residents) == ["b", "c"]


def test_evictions_skip_busy_engines_and_refuse_what_cannot_fit():
    residents = [resident("busy", 8, 0.0, idle=False), resident("idle", 2, 5.0)]
    assert evictions(need=2, budget=12, residents=residents) == []
    assert evictions(need=4, budget=12, residents=residents) == ["idle"]
    assert evictions(need=5, budget=12, residents=residents) is None


def test_no_budget_never_evicts():
    assert evictions(need=10**12, budget=None, residents=[resident("a", 1, 0.0)]) == []
