"""OpenAI dialect: /v1/embeddings."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from quart import Blueprint

from mlxd.api.common.embedding import embed_texts
from mlxd.api.common.generation import parse_body, refuse_unhonoured
from mlxd.api.openai.protocol import EmbeddingRequest

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


def _base64(vector: np.ndarray) -> str:
    """OpenAI's base64 encoding: the little-endian float32 bytes of the vector."""
    return base64.b64encode(vector.astype("<f4").tobytes()).decode()
