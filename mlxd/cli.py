"""mlxd command line: `mlxd [serve] --config FILE`, `mlxd check FILE`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from mlxd import accel
from mlxd.errors import ConfigError

COMMANDS = ("serve", "check")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv.insert(0, "serve")  # `mlxd --config x.yaml` means `mlxd serve --config x.yaml`
    args = _parser().parse_args(argv)
    sys.exit(args.run(args))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxd",
        description="Serve the models a YAML file declares over the OpenAI API.",
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
    serve.set_defaults(run=_serve)

    check = commands.add_parser(
        "check",
        help="validate a config file",
        description="Validate a config file; print every problem with its line and exit 1.",
    )
    check.add_argument("file")
    check.set_defaults(run=_check)
    return parser


def _check(args: argparse.Namespace) -> int:
    from mlxd.config import load_config

    try:
        registry = load_config(args.file)
    except ConfigError as exc:
        print(exc.message, file=sys.stderr)
        return 1
    names = ", ".join(registry.models) or "none"
    print(f"{args.file}: ok ({len(registry.models)} models: {names})")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from mlxd.settings import Settings

    settings = Settings()
    if not settings.no_reexec:
        accel.ensure_optimized_blas()
    logging.basicConfig(
        level=(args.log_level or settings.log_level).upper(),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
    )
    log = logging.getLogger("mlxd")
    from mlxd.api.app import create_app, serve
    from mlxd.api.auth import log_access
    from mlxd.config import load_config
    from mlxd.daemon import Daemon

    path = args.config or settings.config
    try:
        registry = load_config(path)
    except ConfigError as exc:
        log.error("invalid config:\n%s", exc.message)
        return 1
    host = args.host or settings.host or registry.server.host
    port = args.port or settings.port or registry.server.port
    log.info("mlxd on %s; config %s with %d models", accel.describe(), path, len(registry.models))
    log.info("listening on http://%s:%d", host, port)
    log_access(registry, host)
    asyncio.run(serve(create_app(Daemon(registry, Path(path))), host, port))
    return 0
