"""OpenAI dialect: /v1/embeddings."""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np
from quart import Blueprint

from mlxd.api.common.context import current_app
from mlxd.api.common.generation import parse_body, refuse_unhonoured
from mlxd.api.middleware import observe
from mlxd.api.openai.protocol import EmbeddingRequest
from mlxd.errors import InvalidRequest

blueprint = Blueprint("embeddings", __name__)


@blueprint.post("/v1/embeddings")
async def embeddings() -> Any:
    body = await parse_body(EmbeddingRequest)
    refuse_unhonoured(body)
    result, _ = await embed_texts(body.model, body.inputs(), dimensions=body.dimensions)
    as_base64 = body.encoding_format == "base64"
    return {
        "object": "list",
        "data": [
            {
                "object": "embedding",
                "index": index,
                "embedding": _base64(vector) if as_base64 else vector.tolist(),
            }
            for index, vector in enumerate(result.vectors)
        ],
        "model": body.model,
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    }


async def embed_texts(
    model_id: str,
    inputs: list[str] | list[list[int]],
    *,
    dimensions: int | None = None,
    truncate: bool | None = None,
    param: str = "input",
) -> tuple[Any, int]:
    """Embed `inputs` with `model_id` (shared by the OpenAI and Ollama routes); returns the
    engine's result and `time.monotonic_ns()` once the model was loaded. `truncate` None
    follows the model's YAML setting."""
    entry = current_app.daemon.routes.entry(model_id)
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
    engine = await current_app.daemon.engine(model_id)
    loaded = time.monotonic_ns()
    truncate = entry.config.truncate if truncate is None else truncate
    result = await engine.embed(inputs, truncate=truncate, dimensions=dimensions)
    observe.count_prompt_tokens(result.prompt_tokens)
    return result, loaded


def _base64(vector: np.ndarray) -> str:
    """OpenAI's base64 encoding: the little-endian float32 bytes of the vector."""
    return base64.b64encode(vector.astype("<f4").tobytes()).decode()
