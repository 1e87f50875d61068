"""Render `MlxdError`s in the caller's API dialect."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from mlxd.errors import InvalidRequest, MlxdError

OPENAI_TYPES = {
    "invalid_request": "invalid_request_error",
    "not_found": "invalid_request_error",
    "request_too_large": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "rate_limit": "rate_limit_error",
    "timeout": "timeout_error",
    "overloaded": "server_error",
    "server_error": "server_error",
}


def openai_error(error: MlxdError) -> dict[str, Any]:
    code = "model_not_found" if error.kind == "not_found" and error.param == "model" else None
    return {
        "error": {
            "message": error.message,
            "type": OPENAI_TYPES.get(error.kind, "server_error"),
            "param": error.param,
            "code": code,
        }
    }


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


def from_validation_error(exc: ValidationError) -> InvalidRequest:
    """One readable message naming every bad field; `param` is the first of them."""
    problems, params = [], []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
        params.append(loc)
        problems.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    return InvalidRequest("invalid request: " + "; ".join(problems), param=params[0] or None)


def _is_union_tag(part: Any) -> bool:
    # pydantic puts the tried union member ("str", "list[int]", "function-after[...]") in loc.
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))
