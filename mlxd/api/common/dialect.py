"""The seam between the app and an API dialect.

Each dialect package (`mlxd/api/<name>/dialect.py`) hands the app a `Dialect`: its blueprints,
how it renders an error, where its bodies name models and what it calls the internal request's
fields. The app finds them itself (`discover`), so adding a dialect touches no shared module,
and chooses an error's shape by the blueprint that served the request, not by its URL; the
OpenAPI document lists each dialect's own routes and error shape.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from quart import Blueprint, request
from quart.typing import ResponseReturnValue

from mlxd.api.common.context import current_app
from mlxd.api.common.error_shapes import openai_error
from mlxd.errors import MlxdError
from mlxd.types import OverLimit

ErrorRenderer = Callable[[MlxdError], ResponseReturnValue]


@dataclass(frozen=True)
class Route:
    """A route as the OpenAPI document (`api/ops/openapi.py`) lists it."""

    method: str
    path: str  # OpenAPI's {param} syntax
    summary: str
    tag: str
    body: type[BaseModel] | None = None
    streams: bool = False  # answers text/event-stream when the body asks for `stream: true`
    content_type: str = "application/json"
    body_type: str = "application/json"  # multipart/form-data for uploads


# The default error shape (OpenAI's) as a JSON schema, named as the OpenAPI document names it.
DEFAULT_ERROR_SCHEMA = (
    "OpenAIError",
    {
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
    },
)


def body_model(body: Any) -> list[str]:
    """The `model` of a JSON object body: how most requests name their model."""
    model = body.get("model") if isinstance(body, dict) else None
    return [model] if isinstance(model, str) else []


def default_error(error: MlxdError) -> ResponseReturnValue:
    """OpenAI's shape, the one most clients read: for the operational endpoints and for
    paths no dialect claims."""
    return openai_error(error), error.status, error.headers


@dataclass(frozen=True)
class Dialect:
    name: str
    blueprints: tuple[Blueprint, ...]
    render_error: ErrorRenderer = default_error
    # The model ids a request's parsed body names (rate limits are admitted by them): a JSON
    # body, or a multipart form's fields as one object.
    model_ids: Callable[[Any], list[str]] = body_model
    # `GenerationRequest` field → the name this dialect's callers know it by, for errors.
    field_names: Mapping[str, str] = field(default_factory=dict)
    # Requests that match no route under these paths still get this dialect's error shape.
    unrouted_prefixes: tuple[str, ...] = ()
    # What the OpenAPI document lists: the routes, and the error shape as a (name, schema).
    routes: tuple[Route, ...] = ()
    error_schema: tuple[str, dict[str, Any]] = DEFAULT_ERROR_SCHEMA


def discover() -> list[Dialect]:
    """Every `mlxd.api.<package>.dialect.DIALECT`, by package name."""
    import mlxd.api

    found = []
    for package in sorted(pkgutil.iter_modules(mlxd.api.__path__), key=lambda p: p.name):
        if not package.ispkg:
            continue
        try:
            module = importlib.import_module(f"mlxd.api.{package.name}.dialect")
        except ModuleNotFoundError as exc:
            if exc.name != f"mlxd.api.{package.name}.dialect":
                raise
            continue
        declared = getattr(module, "DIALECT", None)  # common/dialect.py is this module
        if isinstance(declared, Dialect):
            found.append(declared)
    return found


class Dialects:
    """The dialects an app serves, found by the blueprint that answered a request."""

    def __init__(self, dialects: list[Dialect]):
        self.all = dialects
        self._by_blueprint = {bp.name: d for d in dialects for bp in d.blueprints}

    def current(self) -> Dialect | None:
        """The dialect serving this request (None: an operational path or no route)."""
        for name in reversed(request.blueprints):  # outermost blueprint last
            if name in self._by_blueprint:
                return self._by_blueprint[name]
        if request.url_rule is None:
            for dialect in self.all:
                prefixes = dialect.unrouted_prefixes
                if prefixes and request.path.startswith(prefixes):
                    return dialect
        return None


def current() -> Dialect | None:
    return current_app.dialects.current()


def render_error(error: MlxdError) -> ResponseReturnValue:
    """`error` in the shape the current request's dialect speaks, its fields named its way."""
    dialect = current()
    if dialect is None:
        return default_error(error)
    if isinstance(error, OverLimit):
        error = error.named(dict(dialect.field_names))
    return dialect.render_error(error)


async def requested_models() -> list[str]:
    """Model ids the request names: its path's `<model_id>` and, for a POST, what its dialect
    finds in the body: a JSON body, or a multipart form's fields (audio uploads) taken as one
    object. A body that is neither is the route's 400."""
    path_args = request.view_args or {}
    ids = [path_args["model_id"]] if isinstance(path_args.get("model_id"), str) else []
    dialect = current()
    if request.method != "POST" or dialect is None:
        return ids
    body: Any
    if request.mimetype == "multipart/form-data":
        body = (await request.form).to_dict()  # parsed once: the route reads the same form
    else:
        try:
            body = json.loads(await request.get_data())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return ids
    return ids + [model_id for model_id in dialect.model_ids(body) if isinstance(model_id, str)]
