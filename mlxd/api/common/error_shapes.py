"""OpenAI's error shape (the default, for paths no dialect claims) and pydantic errors as one
400; each dialect renders its own shape (`Dialect.render_error`)."""

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
