"""The OpenAI dialect as the app takes it: Chat Completions, Completions, Responses,
embeddings, rerank and the model list, in OpenAI's error shape (the app's default)."""

from __future__ import annotations

from mlxd.api.common.dialect import Dialect
from mlxd.api.openai import chat, embeddings, rerank
from mlxd.api.openai.responses import routes as responses

DIALECT = Dialect(
    "openai",
    (chat.blueprint, responses.blueprint, embeddings.blueprint, rerank.blueprint),
)
