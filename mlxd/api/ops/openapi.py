"""`GET /openapi.json`: the HTTP API as an OpenAPI 3.1 document.

Request bodies come from the same pydantic models the routes validate with, so the document
cannot drift from what the daemon accepts. A unit test checks that every route of the app is
listed in `ROUTES` and that the document is valid OpenAPI.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from quart import Blueprint

from mlxd.api.anthropic.batches import CreateBatch
from mlxd.api.anthropic.protocol import CountTokensRequest, MessagesBatchList, MessagesRequest
from mlxd.api.ollama.protocol import (
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    ShowRequest,
)
from mlxd.api.openai.audio_protocol import SpeechBody, TranscriptionUpload
from mlxd.api.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
)
from mlxd.api.openai.rerank_protocol import RerankRequest
from mlxd.api.openai.responses.protocol import ResponseCreateRequest

blueprint = Blueprint("openapi", __name__)


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # OpenAPI's {param} syntax
    summary: str
    tag: str
    body: type[BaseModel] | None = None
    streams: bool = False  # answers text/event-stream when the body asks for `stream: true`
    content_type: str = "application/json"
    body_type: str = "application/json"


ROUTES = (
    Route("post", "/v1/chat/completions", "Chat completion", "openai", ChatCompletionRequest, True),
    Route("post", "/v1/completions", "Text completion", "openai", CompletionRequest, True),
    Route("post", "/v1/embeddings", "Embeddings", "openai", EmbeddingRequest),
    Route("post", "/v1/audio/transcriptions", "Speech to text (kind stt)", "openai",
          TranscriptionUpload, True, body_type="multipart/form-data"),
    Route("post", "/v1/audio/translations", "Speech to English text (kind stt)", "openai",
          TranscriptionUpload, body_type="multipart/form-data"),
    Route("post", "/v1/audio/speech", "Text to speech (kind tts)", "openai", SpeechBody,
          True, content_type="audio/mpeg"),
    Route("get", "/v1/audio/voices", "A speech model's voices (?model=)", "openai"),
    Route("post", "/v1/responses", "Create a response (Responses API)", "openai",
          ResponseCreateRequest, True),
    Route("get", "/v1/responses/{response_id}", "A stored response", "openai"),
    Route("delete", "/v1/responses/{response_id}", "Delete a stored response", "openai"),
    Route("get", "/v1/responses/{response_id}/input_items", "A stored response's input items",
          "openai"),
    Route("post", "/v1/rerank", "Rerank documents (Cohere/Jina shape)", "openai", RerankRequest),
    Route("post", "/v2/rerank", "Rerank documents (Cohere v2 path)", "openai", RerankRequest),
    Route("post", "/rerank", "Rerank documents (Jina/vLLM path)", "openai", RerankRequest),
    Route("get", "/v1/models", "List model ids (names and aliases)", "openai"),
    Route("get", "/v1/models/{model_id}", "One model id", "openai"),
    Route("post", "/v1/messages", "Create a message", "anthropic", MessagesRequest, True),
    Route("post", "/v1/messages/count_tokens", "Count prompt tokens", "anthropic",
          CountTokensRequest),
    Route("post", "/v1/messages/batch", "Messages requests in, their results out (MLX shape)",
          "anthropic", MessagesBatchList),
    Route("post", "/v1/messages/batches", "Create a message batch", "anthropic", CreateBatch),
    Route("get", "/v1/messages/batches", "List message batches", "anthropic"),
    Route("get", "/v1/messages/batches/{batch_id}", "One message batch", "anthropic"),
    Route("post", "/v1/messages/batches/{batch_id}/cancel", "Cancel a batch", "anthropic"),
    Route("delete", "/v1/messages/batches/{batch_id}", "Delete an ended batch", "anthropic"),
    Route("get", "/v1/messages/batches/{batch_id}/results", "Batch results (JSONL)", "anthropic",
          content_type="application/x-jsonl"),
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
    Route("post", "/api/pull", "501: models are declared in the YAML", "ollama"),
    Route("post", "/api/push", "501: models are declared in the YAML", "ollama"),
    Route("post", "/api/create", "501: models are declared in the YAML", "ollama"),
    Route("post", "/api/copy", "501: models are declared in the YAML", "ollama"),
    Route("post", "/api/delete", "501: models are declared in the YAML", "ollama"),
    Route("delete", "/api/delete", "501: models are declared in the YAML", "ollama"),
    Route("get", "/health", "Liveness and readiness", "operations"),
    Route("get", "/v1/status", "Models, queues, throughput, cache, config", "operations"),
    Route("get", "/metrics", "Prometheus metrics", "operations",
          content_type="text/plain"),
    Route("post", "/admin/reload", "Re-read the config file", "operations"),
    Route("post", "/admin/models/{model}/load", "Load a declared model now", "operations"),
    Route("post", "/admin/models/{model}/unload", "Unload a model now", "operations"),
    Route("get", "/openapi.json", "This document", "operations"),
    Route("get", "/", "Web dashboard (also a liveness page)", "dashboard",
          content_type="text/html"),
    Route("get", "/dashboard/static/{filename}", "Dashboard script, style", "dashboard",
          content_type="text/plain"),
    Route("get", "/dashboard/api/state", "Dashboard state: status, history, request log",
          "dashboard"),
    Route("get", "/dashboard/api/events", "Dashboard state every 2 s (server-sent events)",
          "dashboard", content_type="text/event-stream"),
)  # fmt: skip

_OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
        "request_id": {"type": "string"},
    },
}

_OLLAMA_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string"}},
}


@cache
def document() -> dict[str, Any]:
    bodies = sorted({r.body for r in ROUTES if r.body}, key=lambda m: m.__name__)
    refs, schemas = models_json_schema(
        [(model, "validation") for model in bodies],
        ref_template="#/components/schemas/{model}",
    )
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        schema = refs.get((route.body, "validation")) if route.body is not None else None
        paths.setdefault(route.path, {})[route.method] = _operation(route, schema)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "mlxd",
            "version": _version(),
            "description": "OpenAI- and Anthropic-compatible model serving. Errors use the "
            "caller's dialect: Anthropic's shape under /v1/messages, OpenAI's elsewhere.",
        },
        "paths": paths,
        "components": {
            "schemas": {
                **schemas.get("$defs", {}),
                "OpenAIError": _OPENAI_ERROR,
                "AnthropicError": _ANTHROPIC_ERROR,
                "OllamaError": _OLLAMA_ERROR,
            },
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
        # Open unless server.api_keys / a model's api_keys are set; then either header works.
        "security": [{}, {"bearer": []}, {"apiKey": []}],
    }


def _operation(route: Route, body_schema: dict[str, Any] | None) -> dict[str, Any]:
    success: dict[str, Any] = {route.content_type: {"schema": {}}}
    if route.streams:
        success["text/event-stream"] = {"schema": {"type": "string"}}
    if route.path.startswith("/v1/messages"):
        error = "AnthropicError"
    elif route.path.startswith("/api/"):
        error = "OllamaError"
    else:
        error = "OpenAIError"
    error_content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{error}"}}}
    operation: dict[str, Any] = {
        "summary": route.summary,
        "tags": [route.tag],
        "operationId": f"{route.method}_{route.path.strip('/').replace('/', '_')}".replace(
            "{", ""
        ).replace("}", ""),
        "responses": {
            "200": {"description": "Success", "content": success},
            "4XX": {"description": "Invalid request", "content": error_content},
            "5XX": {"description": "Server or model failure", "content": error_content},
        },
    }
    params = [p.strip("{}") for p in route.path.split("/") if p.startswith("{")]
    if params:
        operation["parameters"] = [
            {"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
            for p in params
        ]
    if body_schema is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {route.body_type: {"schema": body_schema}},
        }
    return operation


def _version() -> str:
    try:
        return version("mlxd")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0.0.0"


@blueprint.get("/openapi.json")
async def openapi_json() -> Any:
    return document()
