"""Embedding through a model of kind `embedding`, for every dialect's embedding routes."""

from __future__ import annotations

import time
from typing import Any

from mlxd.api.common.context import current_app
from mlxd.api.middleware import auth, observe
from mlxd.errors import InvalidRequest


async def embed_texts(
    model_id: str,
    inputs: list[str] | list[list[int]],
    *,
    dimensions: int | None = None,
    truncate: bool | None = None,
    param: str = "input",
) -> tuple[Any, int]:
    """Embed `inputs` with `model_id` (every dialect's embedding routes); returns the
    engine's result and `time.monotonic_ns()` once the model was loaded. `truncate` None
    follows the model's YAML setting."""
    entry = current_app.daemon.routes.entry(model_id, auth.caller())
    if entry.config.kind != "embedding":
        raise InvalidRequest(
            f"model '{model_id}' is of kind '{entry.config.kind}'; embeddings need a "
            "model of kind 'embedding'",
            param="model",
        )
    if len(inputs) > entry.config.max_inputs:
        raise InvalidRequest(
            f"{param} has {len(inputs)} items; model '{model_id}' takes at most "
            f"{entry.config.max_inputs} per request (max_inputs)",
            param=param,
        )
    engine = await current_app.daemon.engine(entry.name, auth.caller())
    loaded = time.monotonic_ns()
    truncate = entry.config.truncate if truncate is None else truncate
    result = await engine.embed(inputs, truncate=truncate, dimensions=dimensions)
    observe.count_prompt_tokens(result.prompt_tokens)
    return result, loaded
