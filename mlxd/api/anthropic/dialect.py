"""The Anthropic dialect as the app takes it: Messages, token counting and batches, in
Anthropic's error shape."""

from __future__ import annotations

from typing import Any

from mlxd.api.anthropic import batches, errors, messages
from mlxd.api.common.dialect import Dialect, body_model


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
)
