"""What web pages may do with the daemon: Host check, cross-origin refusal, CORS.

A daemon on localhost or the LAN is reachable from every page its owner's browser opens. Three
rules keep those pages out unless the owner lets them in:

- **Host**: while no API key is set, a request whose `Host` is not a name this daemon serves
  (localhost, an IP address, `server.host`, `server.allowed_hosts`) is refused. A DNS-rebinding
  page reaches the daemon under its own domain name, so this stops it reading an open daemon.
- **Origin**: a browser request from another origin (its `Origin`, or `Sec-Fetch-Site:
  cross-site` where a browser leaves Origin out) is refused unless `server.cors_origins`
  approves it; approved ones get CORS headers and their preflights are answered.
- **JSON**: a page can POST `text/plain` or a form anywhere without a preflight; mlxd's bodies
  are JSON, so a browser's POST whose body is not must come from an approved origin (or, for
  the audio upload routes' multipart forms, from this daemon's own pages). Clients
  that are not browsers (no Origin, no Sec-Fetch-Site: curl, the SDKs) are not concerned.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from quart import Response, request

from mlxd.api.common.context import App, current_app
from mlxd.api.middleware.auth import keys_required
from mlxd.config import Config
from mlxd.errors import Forbidden, MlxdError

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Headers browser code may read from a cross-origin answer (others are hidden from it).
EXPOSED_HEADERS = (
    "x-request-id, request-id, retry-after, x-ratelimit-limit-requests, "
    "x-ratelimit-remaining-requests, x-ratelimit-limit-tokens, x-ratelimit-remaining-tokens"
)
PREFLIGHT_MAX_AGE_S = 600
# OpenAI's upload routes take multipart forms, and the dashboard's playground (a page of this
# origin) posts them: a same-origin page may send a form there.
FORM_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})


class UnsupportedMediaType(MlxdError):
    status = 415
    kind = "invalid_request"


def served_host(host_header: str, config: Config) -> bool:
    """Whether `host_header` (a request's Host, port included) names this daemon."""
    try:
        name = urlsplit(f"//{host_header}").hostname
    except ValueError:
        return False
    if not name:
        return False
    allowed = {host.lower() for host in config.server.allowed_hosts}
    if "*" in allowed or name in allowed or name == config.server.host.strip("[]").lower():
        return True
    if name == "localhost" or name.endswith(".localhost"):  # RFC 6761: always loopback
        return True
    try:
        ipaddress.ip_address(name)  # a literal address cannot be rebound to another host
    except ValueError:
        return False
    return True


def approved_origin(origin: str, config: Config) -> bool:
    """Whether `server.cors_origins` lets pages of `origin` call the daemon."""
    origins = {entry.rstrip("/").lower() for entry in config.server.cors_origins}
    return "*" in origins or origin.rstrip("/").lower() in origins


def _same_origin(origin: str, host_header: str) -> bool:
    try:
        return urlsplit(origin).netloc.lower() == host_header.lower()
    except ValueError:
        return False


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and "+json" in media)


def install(app: App) -> None:
    """First of the request checks: a refused page must not learn even whether it had a key."""

    @app.before_request
    async def guard() -> Response | None:
        config = current_app.daemon.config
        headers = request.headers
        if not keys_required(config) and not served_host(request.host, config):
            raise Forbidden(
                f"host '{request.host}' is not served here: add it to server.allowed_hosts "
                "(while no API key is set, mlxd answers only names it knows, against DNS "
                "rebinding)"
            )
        origin = headers.get("Origin")
        approved = origin is not None and approved_origin(origin, config)
        if origin is not None and not approved and not _same_origin(origin, request.host):
            raise Forbidden(
                f"cross-origin request from '{origin}' refused: add the origin to "
                "server.cors_origins to let its pages call mlxd"
            )
        if origin is None and headers.get("Sec-Fetch-Site") in ("cross-site", "same-site"):
            raise Forbidden("cross-origin browser request without an Origin refused")
        if request.method == "OPTIONS" and approved and "Access-Control-Request-Method" in headers:
            return _preflight()
        browser = origin is not None or "Sec-Fetch-Site" in headers
        if (
            browser
            and not approved
            and request.method not in SAFE_METHODS
            and (request.content_length or "Transfer-Encoding" in headers)
            and not _is_json(headers.get("Content-Type", ""))
            and not (
                request.path in FORM_PATHS
                and origin is not None
                and _same_origin(origin, request.host)
                and headers.get("Content-Type", "").startswith("multipart/form-data")
            )
        ):
            raise UnsupportedMediaType(
                "request bodies must be JSON: send 'Content-Type: application/json'"
            )
        return None

    @app.after_request
    async def cors_headers(response: Response) -> Response:
        origin = request.headers.get("Origin")
        if origin is not None and approved_origin(origin, current_app.daemon.config):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
            response.vary.add("Origin")
        return response


def _preflight() -> Response:
    """An approved origin's preflight: any method and the headers it asks for (keys included:
    they travel in Authorization or x-api-key, never as cookies)."""
    response = Response("", status=204)
    response.headers["Access-Control-Allow-Methods"] = "GET, POST, PUT, PATCH, DELETE, OPTIONS"
    asked = request.headers.get("Access-Control-Request-Headers")
    if asked:
        response.headers["Access-Control-Allow-Headers"] = asked
    response.headers["Access-Control-Max-Age"] = str(PREFLIGHT_MAX_AGE_S)
    return response
