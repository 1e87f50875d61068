"""API key decisions: open, missing, unknown, server and model keys."""

from __future__ import annotations

import pytest

from mlxd.api.middleware.auth import OPEN, identify, presented_key
from mlxd.api.middleware.auth_throttle import MAX_FAILURES, FailedAuthentications
from mlxd.config import ModelConfig
from mlxd.errors import NotFound, Overloaded, Unauthorized

MODELS = {
    "a": ModelConfig(source="/m/a", api_keys=["key-a"]),
    "b": ModelConfig(source="/m/b", api_keys=["key-b", "key-shared"]),
    "c": ModelConfig(source="/m/c", api_keys=["key-shared"]),
    "d": ModelConfig(source="/m/d"),
}


def test_no_keys_anywhere_is_open():
    assert identify([], {"d": MODELS["d"]}, None) is OPEN


@pytest.mark.parametrize("key", [None, "nope", "key-a-longer", "KEY-A"])
def test_missing_or_unknown_key_is_401_without_echoing_it(key):
    with pytest.raises(Unauthorized) as caught:
        identify(["server"], MODELS, key)
    assert key is None or key not in caught.value.message


def test_model_keys_alone_close_the_daemon():
    with pytest.raises(Unauthorized):
        identify([], MODELS, None)


def test_server_key_may_do_everything():
    caller = identify(["server"], MODELS, "server")
    assert caller.admin and all(caller.may_use(name) for name in MODELS)


def test_model_key_may_use_its_models_only():
    caller = identify(["server"], MODELS, "key-shared")
    assert not caller.admin
    assert [name for name in MODELS if caller.may_use(name)] == ["b", "c"]


@pytest.mark.parametrize(
    "headers, key",
    [
        ({"Authorization": "Bearer k1"}, "k1"),
        ({"Authorization": "bearer  k1 "}, "k1"),
        ({"x-api-key": "k2"}, "k2"),
        ({"Authorization": "Bearer ", "x-api-key": "k2"}, "k2"),
        ({"Authorization": "Basic abc"}, None),
        ({}, None),
    ],
)
def test_presented_key(headers, key):
    assert presented_key(headers) == key


def test_a_model_outside_a_keys_reach_is_the_same_404_as_an_unknown_one():
    from mlxd.control.routes import ModelEntry, RouteTable

    aliased = ModelConfig(source="/m/a", api_keys=["key-a"], aliases=["alpha"])
    routes = RouteTable(
        {"a": ModelEntry("a", aliased, "loaded"), "d": ModelEntry("d", MODELS["d"], "loaded")}
    )
    key_a = identify([], {"a": aliased, "d": MODELS["d"]}, "key-a")
    assert routes.entry("alpha:latest", key_a).name == "a"
    messages = set()
    for model_id in ("d", "d:latest", "nope"):
        with pytest.raises(NotFound) as caught:
            routes.entry(model_id, key_a)
        messages.add(caught.value.message.replace(repr(model_id), "ID"))
    assert messages == {"model ID does not exist; available models: a, alpha"}
    assert routes.entry("d:latest", OPEN).name == "d"


@pytest.mark.parametrize(
    ("host", "served"),
    [
        ("localhost:8000", True),
        ("app.localhost", True),
        ("127.0.0.1:8000", True),
        ("[::1]:8000", True),
        ("192.168.1.20:8000", True),
        ("mlxd.home.arpa:8000", True),
        ("MLXD.HOME.ARPA", True),
        ("box.lan", True),  # server.host
        ("attacker.example:8000", False),
        ("localhost.attacker.example", False),
        ("", False),
    ],
)
def test_served_hosts(host: str, served: bool):
    from mlxd.api.middleware.browser import served_host
    from mlxd.config import Config

    config = Config.model_validate(
        {"server": {"host": "box.lan", "allowed_hosts": ["mlxd.home.arpa"]}}
    )
    assert served_host(host, config) is served


def test_cors_origins_match_exactly_and_star_needs_keys():
    from pydantic import ValidationError

    from mlxd.api.middleware.browser import approved_origin
    from mlxd.config import Config

    config = Config.model_validate({"server": {"cors_origins": ["http://app.test:3000/"]}})
    assert approved_origin("http://app.test:3000", config)
    assert not approved_origin("http://app.test:3001", config)
    assert not approved_origin("https://app.test:3000", config)
    with pytest.raises(ValidationError, match="needs api_keys"):
        Config.model_validate({"server": {"cors_origins": ["*"]}})
    keyed = Config.model_validate({"server": {"cors_origins": ["*"], "api_keys": ["k"]}})
    assert approved_origin("http://anything.test", keyed)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_address_that_keeps_failing_is_throttled_for_a_while():
    clock = Clock()
    throttle = FailedAuthentications(clock)
    for _ in range(MAX_FAILURES):
        throttle.check("10.0.0.9")
        throttle.failed("10.0.0.9")
        clock.now += 1
    with pytest.raises(Overloaded) as caught:
        throttle.check("10.0.0.9")
    assert caught.value.headers["Retry-After"] == str(60 - MAX_FAILURES)
    throttle.check("10.0.0.7")  # another address is not affected
    clock.now += 60
    throttle.check("10.0.0.9")
    throttle.failed("10.0.0.7")
    assert throttle.tracked == 1  # the first address's stale failures were forgotten
