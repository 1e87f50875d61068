"""The OpenAI dialect as the app takes it: Chat Completions, Completions, Responses,
embeddings, rerank, audio (transcription, translation, speech) and the model list, in OpenAI's
error shape (the app's default)."""

from __future__ import annotations

from mlxd.api.common.dialect import Dialect, Route
from mlxd.api.openai import audio, chat, embeddings, rerank, speech
from mlxd.api.openai.audio_protocol import SpeechBody, TranscriptionUpload
from mlxd.api.openai.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from mlxd.api.openai.rerank_protocol import RerankRequest
from mlxd.api.openai.responses import routes as responses
from mlxd.api.openai.responses.protocol import ResponseCreateRequest

ROUTES = (
    Route("post", "/v1/chat/completions", "Chat completion", "openai", ChatCompletionRequest, True),
    Route("post", "/v1/completions", "Text completion", "openai", CompletionRequest, True),
    Route("post", "/v1/embeddings", "Embeddings", "openai", EmbeddingRequest),
    Route("post", "/v1/audio/transcriptions", "Speech to text (kind stt)", "openai",
          TranscriptionUpload, True, body_type="multipart/form-data"),
    Route("post", "/v1/audio/translations", "Speech to English text (kind stt)", "openai",
          TranscriptionUpload, body_type="multipart/form-data"),
    Route("post", "/v1/audio/speech", "Text to speech (kind tts)", "openai", SpeechBody,
          True, content_type="audio/mpeg"),
    Route("get", "/v1/audio/voices", "A speech model's voices (?model=)", "openai"),
    Route("post", "/v1/responses", "Create a response (Responses API)", "openai",
          ResponseCreateRequest, True),
    Route("get", "/v1/responses/{response_id}", "A stored response", "openai"),
    Route("delete", "/v1/responses/{response_id}", "Delete a stored response", "openai"),
    Route("get", "/v1/responses/{response_id}/input_items", "A stored response's input items",
          "openai"),
    Route("post", "/v1/rerank", "Rerank documents (Cohere/Jina shape)", "openai", RerankRequest),
    Route("post", "/v2/rerank", "Rerank documents (Cohere v2 path)", "openai", RerankRequest),
    Route("post", "/rerank", "Rerank documents (Jina/vLLM path)", "openai", RerankRequest),
    Route("get", "/v1/models", "List model ids (names and aliases)", "openai"),
    Route("get", "/v1/models/{model_id}", "One model id", "openai"),
)  # fmt: skip

DIALECT = Dialect(
    "openai",
    (
        chat.blueprint,
        responses.blueprint,
        embeddings.blueprint,
        rerank.blueprint,
        audio.blueprint,
        speech.blueprint,
    ),
    routes=ROUTES,
)
