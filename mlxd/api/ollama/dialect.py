"""The Ollama dialect as the app takes it: /api/*, in Ollama's error shape."""

from __future__ import annotations

from typing import Any

from quart.typing import ResponseReturnValue

from mlxd.api.common.dialect import Dialect, Route, body_model
from mlxd.api.ollama import routes
from mlxd.api.ollama.protocol import (
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    PullRequest,
    ShowRequest,
)
from mlxd.errors import MlxdError

ROUTES = (
    Route("post", "/api/chat", "Chat (NDJSON unless stream: false)", "ollama", ChatRequest,
          content_type="application/x-ndjson"),
    Route("post", "/api/generate", "Generate (NDJSON unless stream: false)", "ollama",
          GenerateRequest, content_type="application/x-ndjson"),
    Route("post", "/api/embed", "Embeddings", "ollama", EmbedRequest),
    Route("post", "/api/embeddings", "One embedding (older route)", "ollama", EmbeddingsRequest),
    Route("get", "/api/tags", "Declared models", "ollama"),
    Route("get", "/api/ps", "Loaded models", "ollama"),
    Route("post", "/api/show", "One model", "ollama", ShowRequest),
    Route("get", "/api/version", "Ollama API version", "ollama"),
    Route("post", "/api/pull", "Pull: success at once for a model the YAML declares, 404 for "
          "another (NDJSON unless stream: false)", "ollama", PullRequest,
          content_type="application/x-ndjson"),
    Route("post", "/api/push", "501: models are declared in the YAML", "ollama"),
    Route("post", "/api/create", "501: models are declared in the YAML", "ollama"),
    Route("post", "/api/copy", "501: models are declared in the YAML", "ollama"),
    Route("post", "/api/delete", "501: models are declared in the YAML", "ollama"),
    Route("delete", "/api/delete", "501: models are declared in the YAML", "ollama"),
)  # fmt: skip

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string"}},
}


def render_error(error: MlxdError) -> ResponseReturnValue:
    return {"error": error.message}, error.status, error.headers


def model_ids(body: Any) -> list[str]:
    """`model`, and `name` where older clients name the model so (/api/show)."""
    name = body.get("name") if isinstance(body, dict) else None
    return body_model(body) + ([name] if isinstance(name, str) else [])


DIALECT = Dialect(
    "ollama",
    (routes.blueprint,),
    routes=ROUTES,
    error_schema=("OllamaError", ERROR_SCHEMA),
    render_error=render_error,
    model_ids=model_ids,
    field_names={"stop": "options.stop", "response_format": "format"},
    unrouted_prefixes=("/api/",),
)
