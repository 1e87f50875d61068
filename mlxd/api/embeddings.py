"""OpenAI dialect: /v1/embeddings."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from quart import Blueprint, current_app

from mlxd.api import observe
from mlxd.api.generation import parse_body, refuse_unhonoured
from mlxd.api.protocol.openai import EmbeddingRequest
from mlxd.errors import InvalidRequest

blueprint = Blueprint("embeddings", __name__)


@blueprint.post("/v1/embeddings")
async def embeddings() -> Any:
    body = await parse_body(EmbeddingRequest)
    refuse_unhonoured(body)
    entry = current_app.daemon.routes.entry(body.model)
    if entry.config.kind != "embedding":
        raise InvalidRequest(
            f"model '{body.model}' is of kind '{entry.config.kind}'; /v1/embeddings needs a "
            "model of kind 'embedding'",
            param="model",
        )
    inputs = body.inputs()
    if len(inputs) > entry.config.max_inputs:
        raise InvalidRequest(
            f"input has {len(inputs)} items; model '{body.model}' takes at most "
            f"{entry.config.max_inputs} per request (max_inputs)",
            param="input",
        )
    engine = await current_app.daemon.engine(body.model)
    result = await engine.embed(inputs, truncate=entry.config.truncate, dimensions=body.dimensions)
    observe.count_prompt_tokens(result.prompt_tokens)
    encode = _base64 if body.encoding_format == "base64" else np.ndarray.tolist
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": index, "embedding": encode(vector)}
            for index, vector in enumerate(result.vectors)
        ],
        "model": body.model,
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    }


def _base64(vector: np.ndarray) -> str:
    """OpenAI's base64 encoding: the little-endian float32 bytes of the vector."""
    return base64.b64encode(vector.astype("<f4").tobytes()).decode()
