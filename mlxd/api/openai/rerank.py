"""/v1/rerank (and /rerank, /v2/rerank: the paths Cohere, Jina and vLLM clients call), served by
an embedding model: documents ranked by the cosine of their embedding with the query's.

A bi-encoder ranks less sharply than a cross-encoder, but any embedding model a home lab
already runs for RAG can then also serve Open WebUI's "external" reranker.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from quart import Blueprint

from mlxd.api.common.context import current_app
from mlxd.api.common.generation import new_id, parse_body
from mlxd.api.middleware import auth, observe
from mlxd.api.openai.rerank_protocol import RerankRequest
from mlxd.errors import InvalidRequest

blueprint = Blueprint("rerank", __name__)


@blueprint.post("/v1/rerank")
@blueprint.post("/v2/rerank")
@blueprint.post("/rerank")
async def rerank() -> Any:
    body = await parse_body(RerankRequest)
    entry = current_app.daemon.routes.entry(body.model, auth.caller())
    if entry.config.kind != "embedding":
        raise InvalidRequest(
            f"model '{body.model}' is of kind '{entry.config.kind}'; /v1/rerank needs a model "
            "of kind 'embedding'",
            param="model",
        )
    documents = body.texts()
    if len(documents) + 1 > entry.config.max_inputs:  # the query is embedded alongside
        raise InvalidRequest(
            f"documents has {len(documents)} items; model '{body.model}' embeds at most "
            f"{entry.config.max_inputs} inputs per request (max_inputs), the query included",
            param="documents",
        )
    engine = await current_app.daemon.engine(entry.name, auth.caller())
    result = await engine.embed([body.query, *documents], truncate=entry.config.truncate)
    observe.count_prompt_tokens(result.prompt_tokens)
    scores = cosine(result.vectors[0], result.vectors[1:])
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[: body.top_n]
    results = []
    for index in order:
        item: dict[str, Any] = {"index": index, "relevance_score": scores[index]}
        if body.return_documents:
            item["document"] = {"text": documents[index]}
        results.append(item)
    return {
        "id": new_id("rerank-"),
        "model": body.model,
        "results": results,
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    }


def cosine(query: np.ndarray, documents: list[np.ndarray] | np.ndarray) -> list[float]:
    """Cosine similarity of `query` with each document vector (normalised here whatever the
    model's pooling did)."""
    matrix = np.asarray(documents, dtype=np.float64)
    query = np.asarray(query, dtype=np.float64)
    norms = np.linalg.norm(matrix, axis=1) * np.linalg.norm(query)
    return (matrix @ query / np.maximum(norms, 1e-12)).tolist()
