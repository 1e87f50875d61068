"""A reload applies the server settings a running daemon can change and keeps the others (its
sockets, its workers' kind, its caches' place) until a restart, as its log says."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import yaml

from mlxd.config import load_config
from mlxd.daemon import Daemon


def write(path: Path, cache_dir: Path, workers: str, drain_timeout: float) -> None:
    server = {"cache_dir": str(cache_dir), "workers": workers, "drain_timeout": drain_timeout}
    path.write_text(yaml.safe_dump({"server": server, "models": {}}))


def test_a_reload_keeps_what_only_a_restart_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    path = tmp_path / "models.yaml"
    write(path, tmp_path / "a", "process", 30)
    daemon = Daemon(load_config(path), path)
    write(path, tmp_path / "b", "inline", 5)
    with caplog.at_level(logging.WARNING, "mlxd"):
        asyncio.run(daemon.reload())
    for server in (daemon.config.server, daemon.reconciler.server):
        assert server.workers == "process"
        assert Path(server.cache_dir) == tmp_path / "a"
        assert server.drain_timeout == 5  # what a reload does change
    assert "server.workers changed: takes effect after a restart" in caplog.text
    assert "server.cache_dir changed: takes effect after a restart" in caplog.text
