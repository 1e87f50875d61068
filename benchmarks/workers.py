"""What running each model in its own worker process costs and buys, in one run.

1. Transport: the same sweep against `server.workers: process` (the default) and `inline` (the
   engine on a thread of the daemon), alternating, best of `--rounds`: the process boundary
   should cost at most a few percent of aggregate tok/s.
2. Load while serving: streaming tok/s of a running model alone, then while another model is
   loaded and unloaded again and again beside it, for both transports: a worker loads at a lower
   CPU priority, so the running model keeps most of its speed.

python -m benchmarks.workers --levels 1,8,32 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import platform
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402

from benchmarks.compare import (  # noqa: E402
    free_port,
    resolve_model_dir,
    running_server,
    server_env,
)
from mlxd.cli.loadgen import (  # noqa: E402
    LevelResult,
    parse_levels,
    run_sweep,
    story_prompts,
    stream_chat,
)

TRANSPORTS = ("process", "inline")


def write_config(workdir: Path, model_dir: Path, port: int, transport: str) -> list[str]:
    config = {
        "server": {
            "host": "127.0.0.1",
            "port": port,
            "cache_dir": str(workdir / f"cache-{transport}"),
            "workers": transport,
        },
        "models": {
            "smol": {"source": str(model_dir), "batch": {"max_batch_size": 32}},
            # Loaded and unloaded on demand during the load-while-serving scenario.
            "other": {"source": str(model_dir), "load": "lazy", "cache": {"ram": 0}},
        },
    }
    path = workdir / f"mlxd-{transport}.yaml"
    path.write_text(yaml.safe_dump(config))
    return [sys.executable, "-m", "mlxd", "--config", str(path)]


async def stream_for(url: str, seconds: float, clients: int, max_tokens: int) -> float:
    """Aggregate completion tok/s of `clients` streams kept busy for `seconds`."""
    prompts = story_prompts()
    deadline = time.perf_counter() + seconds
    tokens = 0
    async with httpx.AsyncClient(timeout=600.0, trust_env=False) as client:

        async def one() -> None:
            nonlocal tokens
            while time.perf_counter() < deadline:
                result = await stream_chat(client, url, "smol", next(prompts), max_tokens)
                tokens += result.completion_tokens

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(clients)))
        return tokens / (time.perf_counter() - started)


async def load_cycles(url: str, seconds: float) -> int:
    """Load and unload `other` until `seconds` have passed; how many loads completed."""
    deadline = time.perf_counter() + seconds
    loads = 0
    async with httpx.AsyncClient(timeout=600.0, trust_env=False) as client:
        while time.perf_counter() < deadline:
            (await client.post(f"{url}/admin/models/other/load")).raise_for_status()
            (await client.post(f"{url}/admin/models/other/unload")).raise_for_status()
            loads += 1
    return loads


async def load_while_serving(url: str, seconds: float, clients: int) -> tuple[float, float, int]:
    alone = await stream_for(url, seconds, clients, 32)
    during, loads = await asyncio.gather(
        stream_for(url, seconds, clients, 32), load_cycles(url, seconds)
    )
    return alone, during, loads


def best(runs: list[list[LevelResult]]) -> dict[int, LevelResult]:
    by_level: dict[int, LevelResult] = {}
    for results in runs:
        for result in results:
            kept = by_level.get(result.concurrency)
            if kept is None or result.tokens_per_s > kept.tokens_per_s:
                by_level[result.concurrency] = result
    return by_level


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=parse_levels, default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=1, help="sweeps per transport (best kept)")
    parser.add_argument("--load-seconds", type=float, default=20.0)
    parser.add_argument("--load-clients", type=int, default=8)
    parser.add_argument("--skip-load", action="store_true", help="transport sweep only")
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/mlxd").expanduser())
    args = parser.parse_args(argv)

    model_dir = resolve_model_dir(None, args.cache_dir)
    env = server_env()
    workdir = Path(tempfile.mkdtemp(prefix="mlxd-workers-"))
    cpu = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in lines if "model name" in ln), cpu)
    print(f"{cpu}; model dir {model_dir}; levels {args.levels}; rounds {args.rounds}", flush=True)

    sweeps: dict[str, list[list[LevelResult]]] = {t: [] for t in TRANSPORTS}
    loading: dict[str, tuple[float, float, int]] = {}
    for round_ in range(args.rounds):
        for transport in TRANSPORTS:
            port = free_port()
            cmd = write_config(workdir, model_dir, port, transport)
            log = workdir / f"{transport}-{round_}.log"
            with running_server(cmd, port, env, log, 600.0) as url:
                results = asyncio.run(
                    run_sweep(url, "smol", args.levels, args.max_tokens, args.requests)
                )
                sweeps[transport].append(results)
                line = ", ".join(f"C={r.concurrency} {r.tokens_per_s:.1f} tok/s" for r in results)
                print(f"round {round_ + 1} {transport}: {line}", flush=True)
                if round_ == 0 and not args.skip_load:
                    loading[transport] = asyncio.run(
                        load_while_serving(url, args.load_seconds, args.load_clients)
                    )

    process, inline = best(sweeps["process"]), best(sweeps["inline"])
    print(f"\n{'streams':>7} | {'process tok/s':>13} | {'inline tok/s':>12} | {'ratio':>6}")
    for level in args.levels:
        ours, theirs = process[level], inline[level]
        print(
            f"{level:>7} | {ours.tokens_per_s:>13.1f} | {theirs.tokens_per_s:>12.1f} | "
            f"{ours.tokens_per_s / theirs.tokens_per_s:>5.3f}x"
        )
    if loading:
        print(f"\nload while serving ({args.load_clients} streams, {args.load_seconds:.0f} s each)")
        print(f"{'transport':>9} | {'alone':>7} | {'loading':>7} | {'kept':>5} | loads")
        for transport, (alone, during, loads) in loading.items():
            print(
                f"{transport:>9} | {alone:>7.1f} | {during:>7.1f} | "
                f"{during / alone:>5.0%} | {loads}"
            )
    failed = sum(r.failed for runs in sweeps.values() for results in runs for r in results)
    print(f"\nfailed requests: {failed}; logs in {workdir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
