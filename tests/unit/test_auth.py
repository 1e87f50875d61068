"""API key decisions: open, missing, unknown, server and model keys."""

from __future__ import annotations

import pytest

from mlxd.api.middleware.auth import OPEN, identify, presented_key
from mlxd.config import ModelConfig
from mlxd.errors import Unauthorized

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
