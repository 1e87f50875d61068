"""The Anthropic dialect as the app takes it: Messages, token counting and batches, in
Anthropic's error shape."""

from __future__ import annotations

from typing import Any

from mlxd.api.anthropic import batches, errors, messages
from mlxd.api.anthropic.batches import CreateBatch
from mlxd.api.anthropic.protocol import CountTokensRequest, MessagesBatchList, MessagesRequest
from mlxd.api.common.dialect import Dialect, Route, body_model

ROUTES = (
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
    Route("get", "/admin/message-batches", "Every key's message batches (server key)",
          "operations"),
    Route("post", "/admin/message-batches/{batch_id}/cancel", "Cancel any key's batch (server "
          "key)", "operations"),
)  # fmt: skip

ERROR_SCHEMA = {
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


def model_ids(body: Any) -> list[str]:
    """A Messages request's `model`; each of a /v1/messages/batch list's; each
    `requests[].params.model` of a Message Batch."""
    if isinstance(body, list):
        return [model for item in body for model in body_model(item)]
    items = body.get("requests") if isinstance(body, dict) else None
    params = (
        [item.get("params") for item in items if isinstance(item, dict)]
        if isinstance(items, list)
        else []
    )
    return body_model(body) + [model for p in params for model in body_model(p)]


DIALECT = Dialect(
    "anthropic",
    (messages.blueprint, batches.blueprint),
    render_error=errors.render,
    model_ids=model_ids,
    field_names={"stop": "stop_sequences"},
    unrouted_prefixes=("/v1/messages",),
    routes=ROUTES,
    error_schema=("AnthropicError", ERROR_SCHEMA),
)
