"""How long a fresh GPU machine makes mlxd's first requests wait, and what the load's warm-up
and the kept compiled kernels change.

python -m benchmarks.gpu_cold_start [--shape llama-3.2-1b | --model-dir DIR] [--max-tokens 16]

MLX's CUDA backend compiles each kernel the first time it meets it (worker/warm_up.py). This
starts mlxd twice on the random-weight model benchmarks.gpu writes: first with an empty
cache_dir and MLX's own kernel cache pointed at an empty folder (what a fresh machine sees),
then with a new cache_dir holding only the first run's kept kernels (cache_dir/mlx-jit: a
reboot, or another model's load, on the same machine). Each run prints the time to ready and,
in order, the first requests a household would send: one greedy, one at top-p, 8 at top-p at
once, 32 greedy at once; time to first token (the slowest of the group) and wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

import httpx2 as httpx  # noqa: E402

from benchmarks import compare  # noqa: E402
from benchmarks.gguf_import import SHAPES  # noqa: E402
from benchmarks.gpu import model_dir  # noqa: E402
from mlxd.accel import backend_name  # noqa: E402
from mlxd.cli.loadgen import SAMPLING, story_prompts, stream_chat  # noqa: E402

# (label, concurrent requests, sampling label): the order they are sent in.
PROBES = (
    ("1 greedy", 1, "greedy"),
    ("1 top-p", 1, "t0.7/p0.9"),
    ("8 top-p", 8, "t0.7/p0.9"),
    ("32 greedy", 32, "greedy"),
)
PTX_ENV = "MLX_PTX_CACHE_DIR"


async def probe(
    url: str, concurrency: int, label: str, max_tokens: int, prompts: Iterator[str]
) -> str:
    async with httpx.AsyncClient(timeout=600.0, trust_env=False) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(
                stream_chat(
                    client, url, compare.MODEL_NAME, next(prompts), max_tokens, SAMPLING[label]
                )
                for _ in range(concurrency)
            )
        )
        wall = time.perf_counter() - start
    failed = [r.error for r in results if not r.ok]
    if failed:
        return f"{len(failed)} of {concurrency} failed: {failed[0]}"
    slowest = max(r.ttft_s or 0.0 for r in results)
    tokens = sum(r.completion_tokens for r in results)
    return f"TTFT (slowest) {slowest:6.2f} s, wall {wall:6.2f} s, {tokens} tokens"


def run(
    directory: Path, cache_dir: Path, args: argparse.Namespace, env: dict[str, str], title: str
) -> None:
    port = compare.free_port()
    workdir = cache_dir.parent
    cmd = compare.mlxd_command(
        directory,
        port,
        workdir,
        model_options={"context_length": args.context_length, "warm_up": True},
        server_options={"cache_dir": str(cache_dir)},
    )
    print(f"== {title}", flush=True)
    start = time.perf_counter()
    log_path = workdir / f"{cache_dir.name}.log"
    with compare.running_server(cmd, port, env, log_path, args.startup_timeout) as url:
        print(f"ready after {time.perf_counter() - start:6.1f} s", flush=True)
        warm_up = httpx.get(f"{url}/v1/status", trust_env=False).json()["models"][
            compare.MODEL_NAME
        ]["warm_up"]
        if warm_up:
            rounds = ", ".join(f"{r['rows']}:{r['seconds']:.1f}" for r in warm_up["rounds"])
            print(f"  warm-up {warm_up['seconds']:.1f} s; rounds (rows:s) {rounds}", flush=True)
        prompts = story_prompts()
        for name, concurrency, label in PROBES:
            line = asyncio.run(probe(url, concurrency, label, args.max_tokens, prompts))
            print(f"  {name:>9}: {line}", flush=True)
    warmed = [line for line in log_path.read_text().splitlines() if "warmed up in" in line]
    print(f"  log: {warmed[-1].strip() if warmed else 'no warm-up line'}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="llama-3.2-1b")
    parser.add_argument("--workdir", type=Path, default=Path("~/.cache/mlxd-bench").expanduser())
    parser.add_argument("--model-dir", type=Path, help="an MLX model directory (default: --shape)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--context-length", type=int, default=2048)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--fresh-only", action="store_true", help="skip the second start")
    args = parser.parse_args(argv)
    backend = backend_name()
    print(f"backend: {backend}" + (" (compiles nothing)" if backend == "cpu" else ""))
    directory = args.model_dir or model_dir(args.workdir, args.shape)
    env = {k: v for k, v in compare.server_env().items() if k != PTX_ENV}
    args.workdir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="cold-start-", dir=args.workdir))
    fresh, kept = root / "fresh", root / "kept"
    run(directory, fresh, args, env, "fresh machine: empty cache_dir and kernel cache")
    kernels = fresh / "mlx-jit"
    count = sum(1 for path in kernels.rglob("*") if path.is_file())
    print(f"  kept {count} compiled kernel files under cache_dir/mlx-jit", flush=True)
    if kernels.is_dir():
        shutil.copytree(kernels, kept / "mlx-jit")
    if not args.fresh_only:
        run(directory, kept, args, env, "a new cache_dir holding only the kept kernels")
    print(f"daemon logs and caches: {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
