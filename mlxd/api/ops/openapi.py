"""`GET /openapi.json`: the HTTP API as an OpenAPI 3.1 document.

Request bodies come from the same pydantic models the routes validate with, so the document
cannot drift from what the daemon accepts. Each dialect lists its own routes (`Dialect.routes`);
a unit test checks that every route of the app is listed and that the document is valid.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from pydantic.json_schema import models_json_schema
from quart import Blueprint

from mlxd.api.common.dialect import Dialect, Route, discover

blueprint = Blueprint("openapi", __name__)


@cache
def document() -> dict[str, Any]:
    """The document for every dialect (`discover`): their routes and error shapes."""
    dialects = discover()
    routes = [(route, dialect) for dialect in dialects for route in dialect.routes]
    bodies = sorted({r.body for r, _ in routes if r.body}, key=lambda m: m.__name__)
    refs, schemas = models_json_schema(
        [(model, "validation") for model in bodies],
        ref_template="#/components/schemas/{model}",
    )
    paths: dict[str, dict[str, Any]] = {}
    for route, dialect in routes:
        schema = refs.get((route.body, "validation")) if route.body is not None else None
        paths.setdefault(route.path, {})[route.method] = _operation(route, dialect, schema)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "mlxd",
            "version": _version(),
            "description": "OpenAI-, Anthropic- and Ollama-compatible model serving. Errors "
            "use the shape of the dialect each route belongs to.",
        },
        "paths": paths,
        "components": {
            "schemas": {
                **schemas.get("$defs", {}),
                **dict(dialect.error_schema for dialect in dialects),
            },
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
        # Open unless server.api_keys / a model's api_keys are set; then either header works.
        "security": [{}, {"bearer": []}, {"apiKey": []}],
    }


def _operation(
    route: Route, dialect: Dialect, body_schema: dict[str, Any] | None
) -> dict[str, Any]:
    success: dict[str, Any] = {route.content_type: {"schema": {}}}
    if route.streams:
        success["text/event-stream"] = {"schema": {"type": "string"}}
    error = dialect.error_schema[0]
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
