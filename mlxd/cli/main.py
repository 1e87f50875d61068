"""mlxd command line: `mlxd [serve] --config FILE`, `mlxd check FILE`, and the client commands
`mlxd ps`, `mlxd reload`, `mlxd bench` that talk to a running daemon."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxd import accel
from mlxd.errors import ConfigError
from mlxd.process_exit import exit_process

if TYPE_CHECKING:
    from mlxd.config import ModelConfig, ServerConfig
    from mlxd.memory_need import MemoryNeed
    from mlxd.runtime.engine import Engine

COMMANDS = ("serve", "check", "ps", "reload", "load", "unload", "bench")
DEFAULT_URL = "http://127.0.0.1:8000"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv.insert(0, "serve")  # `mlxd --config x.yaml` means `mlxd serve --config x.yaml`
    args = _parser().parse_args(argv)
    sys.exit(args.run(args))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxd",
        description="Serve the models a YAML file declares over the OpenAI and Anthropic APIs. "
        "Without a command, `mlxd` means `mlxd serve`.",
    )
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="start the daemon (the default command)",
        description="Load the models in the config file and serve them until SIGINT/SIGTERM.",
    )
    serve.add_argument("--config", help="YAML file (default: $MLXD_CONFIG or config/models.yaml)")
    serve.add_argument("--host", help="override server.host")
    serve.add_argument("--port", type=int, help="override server.port")
    serve.add_argument("--log-level", help="debug, info, warning, error (default: info)")
    serve.add_argument(
        "--log-format",
        choices=("text", "json"),
        help="text lines, or one JSON object per line (default: $MLXD_LOG_FORMAT or text)",
    )
    serve.set_defaults(run=_serve)

    check = commands.add_parser(
        "check",
        help="validate a config file",
        description="Validate a config file and what it can check without loading: adapter "
        "folders, Ollama models, each GGUF's header (architecture, tensor types, tokenizer). "
        "Print every problem with its line and exit 1.",
    )
    check.add_argument("file")
    check.set_defaults(run=_check)

    ps = commands.add_parser(
        "ps",
        help="list the models of a running daemon",
        description="Show each model of a running daemon: kind, state, aliases, memory, "
        "queued and running requests and tokens/s over the last minute (from /v1/status).",
    )
    _client_options(ps)
    ps.set_defaults(run=_ps)

    reload = commands.add_parser(
        "reload",
        help="make a running daemon re-read its config file",
        description="POST /admin/reload: the daemon re-reads its config file and converges on "
        "it. Prints what changed; an invalid file changes nothing and exits 1.",
    )
    _client_options(reload)
    reload.set_defaults(run=_reload)

    for verb, what in (
        ("load", "load a declared model now; it stays loaded until unloaded or idle"),
        ("unload", "unload a model now; it stays declared and its next request loads it"),
    ):
        command = commands.add_parser(
            verb,
            help=what,
            description=f"POST /admin/models/NAME/{verb} on a running daemon: {what}. "
            "Goes through the reconciler; the YAML file is not touched.",
        )
        command.add_argument("model", help="model name or alias")
        _client_options(command)
        command.set_defaults(run=_load_or_unload, verb=verb)

    bench = commands.add_parser(
        "bench",
        help="measure a running daemon's streaming throughput",
        description="Send streaming chat completions to a running daemon at each concurrency "
        "level (distinct prompts, so no prompt cache helps) and print aggregate tokens/s, "
        "TTFT p50/p95 and failures per level.",
    )
    _client_options(bench)
    bench.add_argument("--model", default="default", help="model id to load (default: default)")
    bench.add_argument(
        "--concurrency",
        type=_levels,
        default=[1, 8, 32],
        help="comma-separated levels (default: 1,8,32)",
    )
    bench.add_argument("--max-tokens", type=int, default=64, help="per request (default: 64)")
    bench.add_argument("--requests", type=int, help="requests per level (default: 2×C, min 4)")
    bench.set_defaults(run=_bench)
    return parser


def _client_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=os.environ.get("MLXD_URL", DEFAULT_URL),
        help=f"the daemon's base URL (default: $MLXD_URL or {DEFAULT_URL})",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("MLXD_API_KEY"),
        help="sent as a Bearer token (default: $MLXD_API_KEY)",
    )


def _levels(text: str) -> list[int]:
    from mlxd.cli.loadgen import parse_levels

    return parse_levels(text)


def _check(args: argparse.Namespace) -> int:
    from mlxd.config import load_config
    from mlxd.distributed.config import check_distributed
    from mlxd.models.adapters import check_adapters
    from mlxd.models.source_check import check_sources

    try:
        # Beyond the schema: a distributed model's rank count against its heads and layers,
        # each adapter directory's files, each GGUF's header and Ollama model.
        config = load_config(
            args.file,
            extra_checks=lambda r: check_distributed(r) + check_adapters(r) + check_sources(r),
        )
    except ConfigError as exc:
        print(exc.message, file=sys.stderr)
        return 1
    names = ", ".join(config.models) or "none"
    print(f"{args.file}: ok ({len(config.models)} models: {names})")
    return 0


def _ps(args: argparse.Namespace) -> int:
    from mlxd.cli.http_client import DaemonClient, DaemonError

    try:
        status = DaemonClient(args.url, args.api_key).status()
    except DaemonError as exc:
        print(exc.message, file=sys.stderr)
        return 1
    header: tuple[str, ...] = ("NAME", "KIND", "STATE", "ALIASES", "PID", "RSS", "ESTIMATE", "MLX")
    header += ("PATH", "QUEUE", "RUNNING", "TOK/S")
    rows = [header] + [_ps_row(name, row) for name, row in status["models"].items()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    for name, row in status["models"].items():
        if cpu_path := row.get("cpu_path"):  # the weights' CPU path and the timings behind it
            print(f"{name}: {cpu_path['summary']}")
        for layers in ("float32_layers", "experts"):  # what runs off the kernels, where experts run
            if row.get(layers):
                print(f"{name}: {row[layers]}")
        if row.get("error"):
            print(f"{name}: {row['error']} ({_retry(row)})")
        for rank in (row.get("distributed") or {}).get("ranks", []):
            print(
                f"{name} rank {rank['rank']}: pid {rank['pid']} on {rank['host']} ({rank['state']})"
            )
    if spare := status.get("spare_worker"):  # runtime/spare_worker.py
        print(f"worker pid {spare['pid']} ({_mib(spare['rss_bytes'])}) waits for the next load")
    return 0


def _ps_row(name: str, row: dict[str, Any]) -> tuple[str, ...]:
    loaded = "running" in row
    estimate = row.get("memory_estimate_bytes", row.get("memory_bytes"))
    return (
        name,
        row.get("kind", "-") + _group(row.get("distributed")),
        row["state"],
        ",".join(row.get("aliases") or []) or "-",
        str(row.get("pid") or "-"),
        _mib(row.get("rss_bytes")),
        _mib(estimate),
        _mib(row.get("mlx_active_bytes")),  # what MLX's allocator holds (weights, KV)
        (row.get("cpu_path") or {}).get("plan", "-"),  # packed / float32 / mixed (CPU)
        str(row.get("queue_depth", 0)) if loaded else "-",
        str(row.get("running", 0)) if loaded else "-",
        f"{row.get('tokens_per_s') or 0:.1f}" if loaded else "-",
    )


def _retry(row: dict[str, Any]) -> str:
    """When a failed model is tried again."""
    if row.get("gave_up"):
        return "not retried until its source files or the config change"
    if row.get("next_retry_s") is not None:
        return f"next try in {row['next_retry_s']:.0f}s"
    return "a previous engine keeps serving" if "running" in row else "retrying"


def _group(group: dict[str, Any] | None) -> str:
    """' ring/tensor x3' for a distributed model's KIND column."""
    if not group:
        return ""
    return f" {group['backend']}/{group['strategy']} x{len(group['hosts'] or [])}"


def _mib(size: int | None) -> str:
    return f"{size / 2**20:.0f}MiB" if size else "-"


def _reload(args: argparse.Namespace) -> int:
    from mlxd.cli.http_client import DaemonClient, DaemonError

    try:
        result = DaemonClient(args.url, args.api_key).reload()
    except DaemonError as exc:
        print(exc.message, file=sys.stderr)
        return 1
    actions = result.get("actions") or ["nothing to change"]
    print(f"config generation {result['config']['generation']}:")
    for action in actions:
        print(f"  {action}")
    return 0


def _load_or_unload(args: argparse.Namespace) -> int:
    from mlxd.cli.http_client import DaemonClient, DaemonError

    try:
        result = DaemonClient(args.url, args.api_key).model_action(args.model, args.verb)
    except DaemonError as exc:
        print(exc.message, file=sys.stderr)
        return 1
    print(f"{result['model']}: {result['state']}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from mlxd.cli.loadgen import print_results, run_sweep

    results = asyncio.run(
        run_sweep(
            args.url, args.model, args.concurrency, args.max_tokens, args.requests, args.api_key
        )
    )
    print_results(results)
    return 0 if all(r.failed == 0 for r in results) else 1


def _serve(args: argparse.Namespace) -> int:
    import logging

    from mlxd.logs import setup_logging
    from mlxd.settings import Settings

    settings = Settings()
    if not settings.no_reexec:
        accel.ensure_optimized_blas()
    level, fmt = args.log_level or settings.log_level, args.log_format or settings.log_format
    setup_logging(level, fmt)
    # Worker processes inherit the environment: they log at the same level, in the same format.
    os.environ.update(MLXD_LOG_LEVEL=level, MLXD_LOG_FORMAT=fmt)
    log = logging.getLogger("mlxd")
    # Before the imports below: the first model's worker imports beside them.
    from mlxd.runtime import spare_worker

    spare_worker.start()
    from mlxd.api.app import create_app, serve
    from mlxd.api.middleware.auth import log_access
    from mlxd.config import load_config
    from mlxd.daemon import Daemon

    path = args.config or settings.config
    try:
        config = load_config(path)
    except ConfigError as exc:
        log.error("invalid config:\n%s", exc.message)
        spare_worker.discard()
        return 1
    if config.server.workers == "inline" or all(
        model.distributed is not None for model in config.models.values()
    ):
        spare_worker.discard()  # no model would take it (a reload's models spawn their own)
    host = args.host or settings.host or config.server.host
    port = args.port or settings.port or config.server.port
    log.info("mlxd on %s; config %s with %d models", accel.describe(), path, len(config.models))
    log.info("listening on http://%s:%d", host, port)
    log_access(config, host)
    try:
        asyncio.run(serve(create_app(Daemon(config, Path(path), _start_inline)), host, port))
    except Exception:  # e.g. the port is taken: same exit path, so no native abort either
        log.exception("mlxd stopped on an error")
        exit_process(1)
    log.info("stopped")
    exit_process(0)  # not `return 0`: see mlxd/process_exit.py for why finalization must not run


async def _start_inline(
    name: str,
    config: ModelConfig,
    server: Callable[[], ServerConfig],
    make_room: Callable[[MemoryNeed], Awaitable[None]],
) -> Engine:
    # Imported on first use: only `workers: inline` brings MLX into the daemon's process.
    from mlxd.worker.factory import start_inline

    return await start_inline(name, config, server, make_room)
