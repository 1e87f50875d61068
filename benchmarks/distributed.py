"""A model over 3 loopback ranks: mlxd against `mlx.launch -n 3 … mlx_lm.server`, same weights.

python -m benchmarks.distributed                      # both servers, 1 and 8 streams
python -m benchmarks.distributed --only baseline      # mlx_lm.server's group alone

On a 2-core machine three ranks only add work (every layer's all_sum crosses processes), so
this measures the overhead of running split, not a speed-up. Beside the two servers it times one
decode step's collectives alone on the same ranks (`python -m mlxd.distributed.timing`), at each
concurrency level's batch size: the per-step communication time within either server's step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

import httpx2 as httpx  # noqa: E402

from benchmarks.compare import (  # noqa: E402
    BASELINE_MODEL_ID,
    DEMO_SOURCE,
    MODEL_NAME,
    ServerFailed,
    ServerRun,
    free_port,
    print_comparison,
    resolve_model_dir,
    server_env,
    wait_healthy,
)
from mlxd.cli.loadgen import parse_levels, print_results, run_sweep  # noqa: E402
from mlxd.config import DistributedConfig  # noqa: E402
from mlxd.distributed.launch import (  # noqa: E402
    free_starting_port,
    launch_argv,
    loopback_env,
    loopback_hosts,
    write_hostfile,
)

SERVERS = ("mlxd", "baseline")


def mlxd_command(model_dir: Path, port: int, workdir: Path, block: DistributedConfig) -> list[str]:
    config = {
        "server": {"host": "127.0.0.1", "port": port, "cache_dir": str(workdir / "cache")},
        "models": {
            MODEL_NAME: {
                "source": str(model_dir),
                "batch": {"max_batch_size": 32},
                "distributed": block.model_dump(mode="json", exclude_none=True),
            }
        },
    }
    config_path = workdir / "mlxd.yaml"
    config_path.write_text(yaml.safe_dump(config))
    return [sys.executable, "-m", "mlxd", "--config", str(config_path)]


def baseline_command(
    model_dir: Path, port: int, workdir: Path, block: DistributedConfig
) -> list[str]:
    """mlx_lm.server on every rank (it loads with sharded_load; rank 0 serves HTTP)."""
    server_args = ["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
    return launch_argv(
        block,
        write_hostfile(block, workdir / "baseline"),
        "mlx_lm.server",
        server_args,
        starting_port=free_starting_port(len(block.hosts or ())),
        env=loopback_env(len(block.hosts or ())),
    )


def check_mlxd_runs_the_group(url: str) -> None:
    status = httpx.get(f"{url}/v1/status", timeout=10.0, trust_env=False).json()
    row = status.get("models", {}).get(MODEL_NAME, {})
    if "distributed" not in row:
        raise ServerFailed("this mlxd serves the model in one process (no group in /v1/status)")


def communication_ms(model_dir: Path, block: DistributedConfig, batch: int, workdir: Path) -> Any:
    """One decode step's collectives for `batch` sequences, timed on the same loopback ranks."""
    ranks = len(block.hosts or ())
    argv = launch_argv(
        block,
        write_hostfile(block, workdir / "timing"),
        "mlxd.distributed.timing",
        ["--model-dir", str(model_dir), "--strategy", block.strategy, "--batch", str(batch)],
        starting_port=free_starting_port(ranks),
        env={**loopback_env(ranks), "PYTHONPATH": str(REPO_ROOT)},
        cwd=str(REPO_ROOT),
    )
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=900, stdin=subprocess.PIPE, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])["comm_ms"] if lines else f"failed: {done.stderr[-300:]}"


@contextmanager
def running_group(
    cmd: list[str], port: int, env: dict[str, str], log_path: Path, startup_timeout_s: float
) -> Iterator[str]:
    """Like compare.running_server, but ends the whole process group: mlx.launch's ranks
    (and a daemon's worker ranks) must not outlive the benchmark."""
    url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
            start_new_session=True,
        )  # fmt: skip
        try:
            wait_healthy(proc, url, startup_timeout_s)
            yield url
        finally:
            _end_group(proc)


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            # The launcher may be gone while ranks linger: sweep the group once more.
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def bench(name: str, cmd: list[str], port: int, model_id: str, args: argparse.Namespace,
          env: dict[str, str], log_dir: Path) -> ServerRun:  # fmt: skip
    log_path = log_dir / f"{name}.log"
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    try:
        with running_group(cmd, port, env, log_path, args.startup_timeout) as url:
            if name == "mlxd":
                check_mlxd_runs_the_group(url)
            results = asyncio.run(
                run_sweep(url, model_id, args.levels, args.max_tokens, args.requests)
            )
    except ServerFailed as exc:
        print(f"{name} skipped/failed: {exc} (log: {log_path})", file=sys.stderr, flush=True)
        return ServerRun(error=str(exc))
    print_results(results)
    return ServerRun(results=results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=parse_levels, default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--strategy", choices=("tensor", "pipeline"), default="tensor")
    parser.add_argument("--only", choices=SERVERS, default=None)
    parser.add_argument("--model-dir", type=Path, default=None, help=f"default: {DEMO_SOURCE}")
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/mlxd").expanduser())
    parser.add_argument("--no-comm", action="store_true", help="skip timing the collectives alone")
    parser.add_argument("--startup-timeout", type=float, default=900.0, metavar="SECONDS")
    args = parser.parse_args(argv)

    model_dir = resolve_model_dir(args.model_dir, args.cache_dir)
    block = DistributedConfig(hosts=loopback_hosts(args.ranks), strategy=args.strategy)
    env = server_env()
    log_dir = Path(tempfile.mkdtemp(prefix="mlxd-bench-dist-"))
    print(f"model dir: {model_dir}; {args.ranks} loopback ranks, {args.strategy}")
    print(f"levels {args.levels}, max_tokens {args.max_tokens}", flush=True)

    runs: dict[str, ServerRun] = {}
    for name in SERVERS:
        if args.only not in (None, name):
            continue
        port = free_port()
        if name == "mlxd":
            cmd, model_id = mlxd_command(model_dir, port, log_dir, block), MODEL_NAME
        else:
            cmd, model_id = baseline_command(model_dir, port, log_dir, block), BASELINE_MODEL_ID
        runs[name] = bench(name, cmd, port, model_id, args, env, log_dir)

    print_comparison(args.levels, runs)
    if not args.no_comm:
        print(f"\none decode step's collectives alone ({args.ranks} ranks, {args.strategy}):")
        for level in args.levels:
            print(f"  batch {level}: {communication_ms(model_dir, block, level, log_dir)} ms")
    if any(run.error for run in runs.values()):
        print(f"\nserver logs kept in {log_dir}")
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 1 if all(run.error for run in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
