"""A small HTTP client for a running daemon: what `mlxd ps` and `mlxd reload` talk to."""

from __future__ import annotations

from typing import Any

import httpx

from mlxd.errors import MlxdError


class DaemonError(MlxdError):
    """The daemon could not be reached or answered with an error."""


class DaemonClient:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 30):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # trust_env=False: HTTP(S)_PROXY must not send loopback traffic elsewhere.
        self._http = httpx.Client(
            base_url=url.rstrip("/"), headers=headers, timeout=timeout, trust_env=False
        )

    def status(self) -> dict[str, Any]:
        return self._call("GET", "/v1/status")

    def reload(self) -> dict[str, Any]:
        return self._call("POST", "/admin/reload")

    def model_action(self, model: str, verb: str) -> dict[str, Any]:
        """POST /admin/models/MODEL/{load,unload}."""
        return self._call("POST", f"/admin/models/{model}/{verb}")

    def _call(self, method: str, path: str) -> dict[str, Any]:
        try:
            response = self._http.request(method, path)
        except httpx.HTTPError as exc:
            raise DaemonError(f"cannot reach mlxd at {self._http.base_url}: {exc}") from exc
        try:
            body = response.json()
        except ValueError:
            body = {}
        if response.is_error:
            raise DaemonError(f"{method} {path}: HTTP {response.status_code}: {_message(body)}")
        return body


def _message(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(body or "no body")
