"""The Ollama dialect as the app takes it: /api/*, in Ollama's error shape."""

from __future__ import annotations

from typing import Any

from quart.typing import ResponseReturnValue

from mlxd.api.common.dialect import Dialect, body_model
from mlxd.api.ollama import routes
from mlxd.errors import MlxdError


def render_error(error: MlxdError) -> ResponseReturnValue:
    return {"error": error.message}, error.status, error.headers


def model_ids(body: Any) -> list[str]:
    """`model`, and `name` where older clients name the model so (/api/show)."""
    name = body.get("name") if isinstance(body, dict) else None
    return body_model(body) + ([name] if isinstance(name, str) else [])


DIALECT = Dialect(
    "ollama",
    (routes.blueprint,),
    render_error=render_error,
    model_ids=model_ids,
    field_names={"stop": "options.stop", "response_format": "format"},
    unrouted_prefixes=("/api/",),
)
