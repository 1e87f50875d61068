"""mlxd and llama.cpp's server on random-weight models shaped like the ones people run.

python -m benchmarks.real_shapes [--shape llama-3.2-1b|llama-3.1-8b] [--levels 1,4,16]

Writes (once, under --workdir) an F16 GGUF shaped like Llama-3.2-1B or Llama-3.1-8B, the Q4_K_M
(or --quant Q4_0, Q5_K_M, Q8_0) that llama.cpp's own `llama-quantize` makes of it, and an MLX
4-bit directory of the same shape (benchmarks/random_llama.py). Then, one server at a time on the
same machine:

- llama.cpp: `llama-server` on the GGUF, one server per level C (`-np C`, 512 tokens a slot,
  as benchmarks.compare runs it), with -t/-tb set to the threads mlxd uses (every core);
- mlxd on that GGUF: a first start with an empty cache dir (conversion, CPU path timing,
  load), then a cached start (the converted weights and timings reused) that serves the sweep;
- mlxd on the MLX 4-bit directory: the same two starts;
- mlxd-gguf-int8 / mlxd-mlx-int8 (asked for in --only): the same with `cpu_activations: int8`
  (x as one int8 term in the integer dot products, llama.cpp's own arithmetic).

Every first load starts with the weights in the page cache, read whole just before (as after a
download; mlxd's conversion hands a GGUF's pages back as it passes them, so the server after it
would otherwise read the file from the disk). It reports each one's load time (process start to
GET /health answering 200; the cached one: the median of every start after the first, with
--restarts more of each server after the sweeps, alternating between them; for mlxd also the
model unloaded and asked for again in its running daemon, --loads-on-request times), the peak RSS
(VmHWM) of the process holding the model (mlxd's model worker, llama-server itself) after
the first load (mlxd's: conversion and packing too), after the cached load and after each
level, and tok/s and TTFT at each level from mlxd's load generator (same prompts, greedy or
`--sampling t0.7/p0.9`, same max_tokens for every server). llama-server maps the GGUF, so its
RSS counts the file's pages it touched; mlxd's worker holds its weights in memory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

import httpx2 as httpx  # noqa: E402
import psutil  # noqa: E402

from benchmarks import held_isa  # noqa: E402
from benchmarks.compare import (  # noqa: E402
    LLAMA_SLOT_TOKENS,
    MODEL_NAME,
    ServerFailed,
    find_llama_server,
    free_port,
    llama_command,
    machine,
    mlxd_command,
    server_env,
    started_server,
)
from benchmarks.gguf_import import SHAPES  # noqa: E402
from benchmarks.random_llama import quantize, write_f16_gguf, write_mlx_4bit  # noqa: E402
from mlxd.cli.loadgen import (  # noqa: E402
    SAMPLING,
    LevelResult,
    parse_levels,
    print_results,
    run_sweep,
)

GIB = 2**30


@dataclass
class PeerRun:
    """One server's figures: load times, peak RSS after load and per level, results."""

    first_load_s: float | None = None
    cached_loads: list[float] = field(default_factory=list)  # every start after the first
    load_rss: int | None = None  # VmHWM right after the load
    first_load_rss: int | None = None  # VmHWM right after the first load (mlxd: conversion too)
    level_rss: dict[int, int] = field(default_factory=dict)  # VmHWM after each level
    results: dict[int, LevelResult] = field(default_factory=dict)
    # mlxd: a load on request in the running daemon (`load_on_request`), each time
    loads_on_request: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def cached_load_s(self) -> float | None:
        """The median of the starts after the first (a single start moves by seconds on a
        shared VM: llama.cpp's between 2.6 and 8.1 s in one session)."""
        return statistics.median(self.cached_loads) if self.cached_loads else None


def peak_rss(pid: int) -> int:
    """VmHWM of process `pid`, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


@contextmanager
def timed_start(
    cmd: list[str], port: int, log: Path, timeout_s: float
) -> Iterator[tuple[str, int, float]]:
    """A started server: its URL, pid and seconds from launch to healthy."""
    started = time.perf_counter()
    with started_server(cmd, port, server_env(), log, timeout_s) as (url, proc):
        yield url, proc.pid, time.perf_counter() - started


def in_page_cache(source: Path) -> None:
    """Read `source` (a file, or a directory's files) whole."""
    for path in [source] if source.is_file() else sorted(source.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                while f.read(64 << 20):
                    pass


def sweep_level(url: str, level: int, args: argparse.Namespace) -> LevelResult:
    sampling = SAMPLING[args.sampling]
    sweep = run_sweep(url, MODEL_NAME, [level], args.max_tokens, args.requests, sampling=sampling)
    results = asyncio.run(sweep)
    return results[0]


def prepare(args: argparse.Namespace, quantizer: Path) -> tuple[Path, Path]:
    """The GGUF (Q4_K_M, or --quant) and the MLX 4-bit directory, written unless already there
    (the directory only where mlxd-mlx runs)."""
    workdir: Path = args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    gguf = workdir / f"{args.shape}.{args.quant}.gguf"
    if not gguf.exists():
        f16 = workdir / f"{args.shape}.F16.gguf"
        print(f"writing {f16} …", flush=True)
        write_f16_gguf(f16, args.shape)
        print(f"{quantizer.name} → {gguf.name} ({args.threads} threads) …", flush=True)
        quantize(quantizer, f16, gguf, args.threads, args.quant)
        f16.unlink()
    mlx_dir = workdir / f"{args.shape}.mlx-4bit"
    wanted = any(name.startswith("mlxd-mlx") for name in args.only)
    if wanted and not (mlx_dir / "config.json").exists():
        print(f"writing {mlx_dir} …", flush=True)
        write_mlx_4bit(mlx_dir, args.shape, gguf)
    return gguf, mlx_dir


def run_llama(binary: Path, gguf: Path, args: argparse.Namespace, logs: Path) -> PeerRun:
    """llama-server sized per level (-np C): a start per level; the first is the first load."""
    run = PeerRun()
    loads: list[float] = []
    for level in args.levels:
        port = free_port()
        cmd = llama_command(binary, gguf, port, level, threads=args.threads)
        print(f"== llama.cpp C={level}: {' '.join(cmd)}", flush=True)
        if not loads:
            in_page_cache(gguf)
        with timed_start(cmd, port, logs / f"llama-{level}.log", args.startup_timeout) as (
            url,
            pid,
            load_s,
        ):
            loads.append(load_s)
            run.first_load_rss = run.first_load_rss or peak_rss(pid)
            run.load_rss = run.load_rss or peak_rss(pid)
            run.results[level] = sweep_level(url, level, args)
            run.level_rss[level] = peak_rss(pid)
    run.first_load_s, run.cached_loads = loads[0], loads[1:]
    run.note = "cached load: the median of its later starts (file in page cache)"
    return run


def restart_llama(binary: Path, gguf: Path, args: argparse.Namespace, logs: Path) -> float:
    """One more start of llama-server at the top level's size, timed and stopped."""
    port = free_port()
    cmd = llama_command(binary, gguf, port, max(args.levels), threads=args.threads)
    with timed_start(cmd, port, logs / "llama-restart.log", args.startup_timeout) as started:
        return started[2]


def run_mlxd(source: Path, name: str, args: argparse.Namespace, logs: Path) -> PeerRun:
    """A first start on an empty cache dir, then a cached start that serves the sweep (with
    `cpu_activations: int8` where `name` ends in -int8)."""
    run = PeerRun()
    workdir = logs / name
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir()
    first_worker: int | None = None
    for phase in ("first", "cached"):
        if first_worker is not None:
            # The first start's worker writes the packed layout for the next load (an 8B's
            # 6 GiB) before it exits, after its daemon stopped: the cached start finds it
            # written, as a restart some time later would.
            _wait_gone(first_worker, args.startup_timeout)
        port = free_port()
        cmd = _mlxd_command(source, name, args, workdir, port)
        print(f"== {name} ({phase} load): {' '.join(cmd)}", flush=True)
        if phase == "first":
            in_page_cache(source)
        with timed_start(cmd, port, logs / f"{name}-{phase}.log", args.startup_timeout) as (
            url,
            _,
            load_s,
        ):
            model = _loaded_model(url, name)
            if phase == "first":
                run.first_load_s, run.first_load_rss = load_s, peak_rss(model["pid"])
                first_worker = model["pid"]
                continue
            run.cached_loads, pid = [load_s], model["pid"]
            run.load_rss = peak_rss(pid)
            path = model.get("cpu_path") or {}
            run.note = f"weights {model.get('dtype')}, CPU path: {path.get('summary', '-')}"
            for level in args.levels:
                run.results[level] = sweep_level(url, level, args)
                run.level_rss[level] = peak_rss(pid)
            for _ in range(args.loads_on_request):
                run.loads_on_request.append(load_on_request(url, name, args.startup_timeout))
    return run


def load_on_request(url: str, name: str, timeout_s: float) -> float:
    """Seconds from a request for the model, unloaded in the running daemon with a worker
    imported for it (control/spare_policy.py), to its one-token answer: what a lazy model's
    first request, a parked model's next one or a switch between models waits. (llama-swap
    starts llama-server for such a request: llama.cpp's cached start.)"""
    pid = _loaded_model(url, name)["pid"]
    unload = f"{url}/admin/models/{MODEL_NAME}/unload"
    httpx.post(unload, timeout=timeout_s, trust_env=False).raise_for_status()
    _wait_gone(pid, timeout_s)
    deadline = time.monotonic() + timeout_s
    while (spare := _status(url)["spare_worker"]) is None or _busy(spare["pid"]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: no worker made ready for the next load")
        time.sleep(0.2)
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 1}
    started = time.perf_counter()
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s, trust_env=False)
    reply.raise_for_status()
    return time.perf_counter() - started


def _busy(pid: int) -> bool:
    """Whether process `pid` used CPU over the last half second (a spare still importing)."""
    process = psutil.Process(pid)
    before = sum(process.cpu_times()[:2])
    time.sleep(0.5)
    return sum(process.cpu_times()[:2]) - before > 0.01


def _mlxd_command(
    source: Path, name: str, args: argparse.Namespace, workdir: Path, port: int
) -> list[str]:
    # llama.cpp's sizing at the top level: that many sequences of LLAMA_SLOT_TOKENS each.
    options: dict[str, object] = {
        "batch": {"max_batch_size": max(args.levels)},
        "context_length": LLAMA_SLOT_TOKENS,
    }
    if name.endswith("-int8"):
        options["cpu_activations"] = "int8"
    budget = {"memory_budget": args.memory_budget} if args.memory_budget else {}
    return mlxd_command(source, port, workdir, model_options=options, server_options=budget)


def _status(url: str) -> dict[str, Any]:
    status: dict[str, Any] = httpx.get(f"{url}/v1/status", timeout=30, trust_env=False).json()
    return status


def _loaded_model(url: str, name: str) -> dict[str, Any]:
    model: dict[str, Any] = _status(url)["models"][MODEL_NAME]
    if model.get("state") != "loaded":
        raise RuntimeError(f"{name}: model not loaded: {model.get('error')}")
    return model


def restart_mlxd(source: Path, name: str, args: argparse.Namespace, logs: Path) -> float:
    """One more cached start of mlxd (run_mlxd's cache dir), timed and stopped."""
    port = free_port()
    cmd = _mlxd_command(source, name, args, logs / name, port)
    with timed_start(cmd, port, logs / f"{name}-restart.log", args.startup_timeout) as started:
        url, _, load_s = started
        pid = _loaded_model(url, name)["pid"]
    _wait_gone(pid, args.startup_timeout)  # its worker gone before the next start
    return load_s


def _wait_gone(pid: int, timeout_s: float) -> None:
    """Return once process `pid` (a daemon's worker, which outlives it a while) has exited."""
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(pid).wait(timeout=timeout_s)


def alternate_restarts(
    runs: dict[str, PeerRun], restarts: dict[str, Callable[[], float]], rounds: int
) -> None:
    """`rounds` more cached starts of every server, one of each in turn: a VM's drift then
    falls on all of them alike."""
    for _ in range(rounds):
        for name, run in runs.items():
            run.cached_loads.append(restarts[name]())


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def report(runs: dict[str, PeerRun], levels: list[int]) -> None:
    print(
        f"\n{'server':<12} {'first load':>11} {'cached load':>12} {'RSS after load':>15} "
        f"{'(first)':>9}"
    )
    for name, run in runs.items():
        print(
            f"{name:<12} {_seconds(run.first_load_s):>11} {_seconds(run.cached_load_s):>12} "
            f"{_gib(run.load_rss):>11} GiB {_gib(run.first_load_rss):>5} GiB"
        )
    print(
        f"\n{'server':<12} {'C':>3} {'tok/s':>7} {'tok/req':>7} {'TTFT p50':>9} {'fail':>5} "
        f"{'peak RSS':>12}"
    )
    for name, run in runs.items():
        for level in levels:
            r = run.results.get(level)
            ttft = "-" if r is None or r.ttft_p50_s is None else f"{r.ttft_p50_s:.2f}s"
            print(
                f"{name:<12} {level:>3} {f'{r.tokens_per_s:.1f}' if r else '-':>7} "
                f"{f'{r.tokens_per_request:.1f}' if r else '-':>7} {ttft:>9} "
                f"{f'{r.failed}/{r.requests}' if r else '-':>5} "
                f"{_gib(run.level_rss.get(level)):>8} GiB"
            )
    peer = runs.get("llama.cpp")
    for name, run in runs.items():
        if peer is None or name == "llama.cpp":
            continue
        loads = [
            f"{label} {ours / theirs:.2f}x"
            for label, ours, theirs in (
                ("first", run.first_load_s, peer.first_load_s),
                ("cached", run.cached_load_s, peer.cached_load_s),
            )
            if ours and theirs
        ]
        if loads:
            print(f"{name} / llama.cpp load time: {', '.join(loads)}")
        for level in levels:
            ours, theirs = run.level_rss.get(level), peer.level_rss.get(level)
            a, b = run.results.get(level), peer.results.get(level)
            if ours and theirs and a and b and b.tokens_per_s:
                print(
                    f"{name} / llama.cpp at C={level}: peak RSS {ours / theirs:.2f}x, "
                    f"tok/s {a.tokens_per_s / b.tokens_per_s:.2f}x"
                )
    for name, run in runs.items():
        if run.cached_loads:
            starts = " / ".join(f"{seconds:.2f}" for seconds in run.cached_loads)
            print(f"{name}: cached starts {starts} s")
    for name, run in runs.items():
        if run.loads_on_request:
            samples = " / ".join(f"{seconds:.2f}" for seconds in run.loads_on_request)
            median = statistics.median(run.loads_on_request)
            start = peer.cached_load_s if peer else None
            ratio = f"; {median / start:.2f}x llama.cpp's cached start" if start else ""
            print(
                f"{name}: a load on request in the running daemon (a worker ready) {samples} s, "
                f"to one token (median {median:.2f} s{ratio})"
            )
    for name, run in runs.items():
        if run.note:
            print(f"{name}: {run.note}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="llama-3.2-1b")
    # Q4_0: issue 25's peer for an MLX 4-bit model (the same bits a weight as MLX's 4-bit);
    # Q5_K_M and Q8_0: the other types people download most.
    parser.add_argument("--quant", choices=["Q4_K_M", "Q4_0", "Q5_K_M", "Q8_0"], default="Q4_K_M")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path("~/.cache/mlxd-bench/real-shapes").expanduser(),
        help="where the models are written once and the servers' logs go",
    )
    parser.add_argument("--levels", type=parse_levels, default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sampling", choices=list(SAMPLING), default="greedy")
    parser.add_argument("--requests", type=int, default=None, help="per level (default 2×C)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--only",
        type=lambda text: text.split(","),
        default=["llama.cpp", "mlxd-gguf", "mlxd-mlx"],
        help="comma-separated, of llama.cpp, mlxd-gguf, mlxd-mlx, mlxd-gguf-int8, "
        "mlxd-mlx-int8 (default: the first three)",
    )
    parser.add_argument("--llama-server", type=Path, default=None, help="llama-server binary")
    held_isa.add_argument(parser)
    parser.add_argument("--startup-timeout", type=float, default=1800.0, metavar="SECONDS")
    parser.add_argument(
        "--restarts",
        type=int,
        default=3,
        help="cached starts of every server after the sweeps, alternating (the cached load "
        "reported: the median of all)",
    )
    parser.add_argument(
        "--loads-on-request",
        type=int,
        default=3,
        help="times mlxd's model is unloaded and asked for again in the running daemon after "
        "the sweeps (what llama-swap does with a start of llama-server)",
    )
    parser.add_argument(
        "--memory-budget",
        default=None,
        help="mlxd's server.memory_budget, e.g. 4GiB: one float32 weights do not fit skips the "
        "CPU path timing (as an 8B's on 24 GiB), which a busy machine repeats at every load",
    )
    args = parser.parse_args(argv)

    found = find_llama_server(args.llama_server)
    if found is None or not (quantizer := found.parent / "llama-quantize").exists():
        print("no llama-server and llama-quantize (../shared/tools/build-llama-server)")
        return 1
    if args.isa:
        held_isa.hold_mlxd_to(args.isa)
    binary = held_isa.held_llama_server(args.isa, args.llama_server, found)
    assert binary is not None  # `found` was
    gguf, mlx_dir = prepare(args, quantizer)
    logs = args.workdir / "runs"
    logs.mkdir(exist_ok=True)
    env = server_env()
    print(machine())
    print(f"shape {args.shape}: {gguf} ({gguf.stat().st_size / GIB:.2f} GiB)")
    print(f"LD_PRELOAD (both): {env.get('LD_PRELOAD', '(none)')}")
    print(
        f"levels {args.levels}, max_tokens {args.max_tokens}, {args.sampling} "
        f"{dict(SAMPLING[args.sampling])}, threads {args.threads}"
    )

    runs: dict[str, PeerRun] = {}
    failed = False
    sources = {
        "mlxd-gguf": gguf,
        "mlxd-mlx": mlx_dir,
        "mlxd-gguf-int8": gguf,
        "mlxd-mlx-int8": mlx_dir,
    }
    peers: dict[str, Callable[[], PeerRun]] = {
        "llama.cpp": lambda: run_llama(binary, gguf, args, logs)
    }
    restarts: dict[str, Callable[[], float]] = {
        "llama.cpp": lambda: restart_llama(binary, gguf, args, logs)
    }
    for name, source in sources.items():
        peers[name] = functools.partial(run_mlxd, source, name, args, logs)
        restarts[name] = functools.partial(restart_mlxd, source, name, args, logs)
    for name, run in peers.items():
        if name not in args.only:
            continue
        try:
            runs[name] = run()
        except (ServerFailed, RuntimeError) as exc:  # the other servers still run
            print(f"{name} failed: {exc} (logs: {logs})", file=sys.stderr, flush=True)
            failed = True
            continue
        print(f"-- {name}")
        print_results(list(runs[name].results.values()))
    try:
        alternate_restarts(runs, restarts, args.restarts)
    except (ServerFailed, RuntimeError) as exc:
        print(f"a cached start failed: {exc} (logs: {logs})", file=sys.stderr, flush=True)
        failed = True
    report(runs, args.levels)
    print(f"server logs: {logs}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
