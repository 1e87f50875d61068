"""API keys: who may call, and which models they may use.

`server.api_keys` may use every model and the admin endpoints; `models.<name>.api_keys` may use
only that model (the route table enforces that where a model id is resolved). Keys are read
from the live config on every request, so a reload that adds or removes one applies to the
next request. No key configured anywhere means the daemon is open.
Keys are never logged or echoed back.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Iterable, Mapping

from quart import Quart, g, request
from werkzeug.datastructures import Headers

from mlxd.api.common.context import current_app
from mlxd.api.middleware.auth_throttle import FailedAuthentications
from mlxd.config import Config, ModelConfig
from mlxd.control.routes import OPEN, Caller
from mlxd.errors import Forbidden, Unauthorized

log = logging.getLogger("mlxd.auth")

# The dashboard page and its files carry no state: they load without a key, then ask for one.
OPEN_PATHS = frozenset({"/health", "/"})
OPEN_PREFIXES = ("/dashboard/static/",)
# Operations, not inference: a model key must not reload the config or read every model's state.
ADMIN_PREFIXES = ("/admin/", "/v1/status", "/metrics", "/dashboard/api/")


def keys_required(config: Config) -> bool:
    """Whether any API key is configured (server-wide or for a model)."""
    return bool(config.server.api_keys) or any(m.api_keys for m in config.models.values())


def presented_key(headers: Headers | Mapping[str, str]) -> str | None:
    """The key from `Authorization: Bearer …` (OpenAI clients) or `x-api-key` (Anthropic's)."""
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key") or None


def identify(server_keys: list[str], models: Mapping[str, ModelConfig], key: str | None) -> Caller:
    """The caller `key` makes, or Unauthorized. Every configured key is compared (in constant
    time each), so the time taken does not tell which kind of key matched, if any."""
    model_keys = {name: config.api_keys for name, config in models.items()}
    if not server_keys and not any(model_keys.values()):
        return OPEN
    if key is None:
        raise Unauthorized(
            "missing API key: send it as 'Authorization: Bearer <key>' or an 'x-api-key' header"
        )
    is_server_key = _matches(key, server_keys)
    allowed = frozenset([name for name, keys in model_keys.items() if _matches(key, keys)])
    if is_server_key:
        return OPEN
    if not allowed:
        raise Unauthorized("invalid API key")
    return Caller(admin=False, models=allowed)


def _matches(key: str, keys: Iterable[str]) -> bool:
    found = False
    for candidate in keys:
        found |= hmac.compare_digest(key.encode(), candidate.encode())
    return found


def caller() -> Caller:
    """The current request's caller (open outside a request that passed `authenticate`)."""
    return g.get("caller", OPEN)


def install(app: Quart) -> None:
    """Check every request except OPEN_PATHS before it reaches a route; an address that keeps
    failing is throttled (`auth_throttle`)."""
    throttle = FailedAuthentications()

    @app.before_request
    async def authenticate() -> None:
        if request.path in OPEN_PATHS or request.path.startswith(OPEN_PREFIXES):
            return
        address = request.remote_addr or ""
        throttle.check(address)
        daemon = current_app.daemon
        models = {name: entry.config for name, entry in daemon.routes.models.items()}
        try:
            who = identify(daemon.config.server.api_keys, models, presented_key(request.headers))
        except Unauthorized:
            throttle.failed(address)
            raise
        g.caller = who
        keyed = keys_required(daemon.config)
        g.owner = owner_of(presented_key(request.headers)) if keyed else ""
        if request.path.startswith(ADMIN_PREFIXES) and not who.admin:
            raise Forbidden("this endpoint needs a server key (server.api_keys)")
        # Which models `who` may use is decided where a route resolves its model
        # (`RouteTable.entry(model_id, caller)`), however the request names it.


def owner() -> str:
    """Who the current request acts for, as `owner_of` its key: "" on an open daemon (any key
    passes there, so a key names nobody)."""
    return g.get("owner", "")


def owner_of(key: str | None) -> str:
    """Who owns what a key stores (batches, responses); keys themselves are never written."""
    return hashlib.sha256(key.encode()).hexdigest() if key else ""


def log_access(config: Config, host: str) -> None:
    """Say at startup whether the daemon is open, and shout if it is open beyond this host."""
    server_keys = len(config.server.api_keys)
    keyed = [name for name, model in config.models.items() if model.api_keys]
    if server_keys or keyed:
        log.info(
            "API keys required: %d server key(s); models with their own keys: %s",
            server_keys,
            ", ".join(keyed) or "none",
        )
        if not server_keys:
            log.warning(
                "no server.api_keys: the admin endpoints and models without api_keys "
                "cannot be used by anyone"
            )
        return
    log.info("no API keys configured: every endpoint is open")
    if not _is_loopback(host):
        log.warning(
            "!!! listening on %s with NO API KEYS: anyone who can reach this address may use "
            "every model and reload the config; set server.api_keys !!!",
            host,
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
