"""Anthropic's error shape and statuses."""

from __future__ import annotations

from typing import Any

from quart.typing import ResponseReturnValue

from mlxd.api.middleware import observe
from mlxd.errors import MlxdError

ANTHROPIC_TYPES = {
    "invalid_request": "invalid_request_error",
    "not_found": "not_found_error",
    "request_too_large": "request_too_large",
    "authentication": "authentication_error",
    "permission": "permission_error",
    # mlxd's 429 is a full queue, not a per-key quota: overload, in Anthropic's words.
    "rate_limit": "overloaded_error",
    "timeout": "timeout_error",
    "overloaded": "overloaded_error",
    "server_error": "api_error",
}
ANTHROPIC_OVERLOADED = 529


def anthropic_status(error: MlxdError) -> int:
    """The HTTP status Anthropic clients expect: every overload (a full queue, a model loading
    or restarting, a draining daemon) is Anthropic's 529 `overloaded_error`, which the SDK and
    Claude Code retry; other statuses are the dialect-neutral ones."""
    return ANTHROPIC_OVERLOADED if error.kind in ("rate_limit", "overloaded") else error.status


def anthropic_error(error: MlxdError, request_id: str = "") -> dict[str, Any]:
    """Anthropic's error body (with the request id, as the real API sends); its status is
    `anthropic_status(error)`."""
    body = {
        "type": "error",
        "error": {"type": ANTHROPIC_TYPES.get(error.kind, "api_error"), "message": error.message},
    }
    if request_id:
        body["request_id"] = request_id
    return body


def render(error: MlxdError) -> ResponseReturnValue:
    """A request's error as the Anthropic SDK reads it."""
    return anthropic_error(error, observe.request_id()), anthropic_status(error), error.headers
