"""Process settings: defaults and MLXD_* environment overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from mlxd.config import ServerConfig
from mlxd.settings import Settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("CONFIG", "HOST", "PORT", "LOG_LEVEL", "LOG_FORMAT", "NO_REEXEC"):
        monkeypatch.delenv(f"MLXD_{name}", raising=False)


def test_defaults():
    settings = Settings()
    assert settings.config == Path("config/models.yaml")
    assert (settings.host, settings.port) == (None, None)
    assert (settings.log_level, settings.log_format, settings.no_reexec) == ("info", "text", False)


def test_env_overrides(monkeypatch):
    monkeypatch.setenv("MLXD_CONFIG", "/etc/mlxd/models.yaml")
    monkeypatch.setenv("MLXD_PORT", "9001")
    monkeypatch.setenv("MLXD_HOST", "0.0.0.0")
    monkeypatch.setenv("MLXD_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("MLXD_LOG_FORMAT", "json")
    monkeypatch.setenv("MLXD_NO_REEXEC", "1")
    settings = Settings()
    assert settings.config == Path("/etc/mlxd/models.yaml")
    assert (settings.host, settings.port) == ("0.0.0.0", 9001)
    assert (settings.log_level, settings.log_format, settings.no_reexec) == ("debug", "json", True)


def test_unrelated_mlxd_variables_are_ignored(monkeypatch):
    monkeypatch.setenv("MLXD_API_KEY", "for-yaml-interpolation")
    assert Settings().port is None


@pytest.mark.parametrize(("name", "value"), [("MLXD_PORT", "0"), ("MLXD_LOG_FORMAT", "xml")])
def test_bad_env_values_are_rejected(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError):
        Settings()


def test_apply_to_overrides_only_what_is_set(monkeypatch):
    server = ServerConfig(host="127.0.0.1", port=8000)
    assert Settings().apply_to(server) == server
    monkeypatch.setenv("MLXD_PORT", "9001")
    assert Settings().apply_to(server) == ServerConfig(host="127.0.0.1", port=9001)
    assert Settings(host="0.0.0.0").apply_to(server).host == "0.0.0.0"
