"""Ollama dialect: /api/chat, /api/generate, /api/embed(dings); the model routes (/api/tags,
/api/ps, /api/show, /api/version, the 501s) are in ollama_models.py, the translation both ways
in ollama_translate.py.

Requests become the same `GenerationRequest` as every other dialect's and go through
`generation.start`; answers are rendered from the one parsed part stream. A streamed answer
is NDJSON (Ollama's default); `stream: false` folds the very same chunks into one object, so
both agree by construction. Errors are Ollama's `{"error": "message"}` (see dialect.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, cast

from quart import Blueprint, Response, make_response

from mlxd.api.common.context import current_app
from mlxd.api.common.embedding import embed_texts
from mlxd.api.common.generation import generation_engine, parse_body, start
from mlxd.api.middleware import auth
from mlxd.api.ollama import models as ollama_models
from mlxd.api.ollama.protocol import (
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    Message,
    keep_alive_seconds,
)
from mlxd.api.ollama.render import fold, iso_time
from mlxd.api.ollama.translate import Timing, internal_message, message_chunks, sampling_request
from mlxd.errors import InvalidRequest, MlxdError

blueprint = Blueprint("ollama", __name__)
blueprint.register_blueprint(ollama_models.blueprint)

NDJSON = "application/x-ndjson"


def _keep_alive(model: str, value: Any) -> float | None:
    """Apply a request's keep_alive to its model (through the daemon, never the YAML);
    returns it in seconds, 0 meaning "unload once this request is done"."""
    try:
        seconds = keep_alive_seconds(value)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="keep_alive") from None
    if seconds:  # 0 is applied after the request: unload
        current_app.daemon.set_keep_alive(model, auth.caller(), seconds)
    return seconds


def _unload_if_asked(model: str, seconds: float | None) -> Callable[[], Awaitable[None]]:
    """What keep_alive 0 does after an answer: unload, when the caller may unload it for
    everyone. The caller and the daemon are bound now: a stream ends outside the request."""
    caller, daemon = auth.caller(), current_app.daemon

    async def unload() -> None:
        if seconds == 0 and caller.admin:
            await daemon.unload_model(model, caller)

    return unload


async def _respond(
    head: dict[str, Any],
    chunks: AsyncGenerator[dict[str, Any], None],
    render: Any,
    stream: bool,
    after: Callable[[], Awaitable[None]],
) -> Any:
    """NDJSON (one line per chunk, the last with `done: true`) or, with `stream: false`, the
    chunks folded into one object. `after` runs once the answer is complete (keep_alive 0).
    A failure after the headers went out is Ollama's `{"error": ...}` line."""
    if not stream:
        try:
            folded = await fold(chunks)
        finally:
            await after()
        return {**head, **render(folded)}

    async def lines() -> AsyncIterator[bytes]:
        try:
            async with aclosing(chunks):
                async for chunk in chunks:
                    yield _line({**head, **render(chunk), "done": chunk.get("done", False)})
        except MlxdError as exc:
            yield _line({"error": exc.message})
            return
        await after()

    # Quart's own Response (the stub's union also admits werkzeug's, which has no timeout).
    response = cast(Response, await make_response(lines(), 200, {"Content-Type": NDJSON}))
    response.timeout = None
    return response


def _line(payload: dict[str, Any]) -> bytes:
    return (json.dumps(payload, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


async def _load_or_unload(body: ChatRequest | GenerateRequest, model: str, keep: float | None):
    """Ollama's empty request: load the model (or with keep_alive 0 unload it); no text."""
    if keep == 0:
        await current_app.daemon.unload_model(model, auth.caller())
        reason = "unload"
    else:
        await current_app.daemon.load_model(model, auth.caller())
        reason = "load"
    return {"model": body.model, "created_at": iso_time(), "done": True, "done_reason": reason}


@blueprint.post("/api/chat")
async def chat() -> Any:
    body = await parse_body(ChatRequest)
    model, timing = body.model, Timing()
    keep = _keep_alive(model, body.keep_alive)
    if not body.messages:
        empty = await _load_or_unload(body, model, keep)
        return {**empty, "message": {"role": "assistant", "content": ""}}
    entry, engine = await generation_engine(model)
    timing.loaded = time.monotonic_ns()
    generation = sampling_request(
        body,
        entry,
        messages=[internal_message(m, i) for i, m in enumerate(body.messages)],
        tools=body.tools or None,
    )
    parts = await start(entry, engine, generation)
    chunks = message_chunks(parts, timing, think=body.think is not False)

    def render(chunk: dict[str, Any]) -> dict[str, Any]:
        message = {"role": "assistant", "content": chunk.get("content", "")}
        for key in ("thinking", "tool_calls"):
            if chunk.get(key):
                message[key] = chunk[key]
        stats = {k: v for k, v in chunk.items() if k not in ("content", "thinking", "tool_calls")}
        return {"message": message, **stats}

    head = {"model": body.model, "created_at": iso_time()}
    return await _respond(head, chunks, render, body.stream, _unload_if_asked(model, keep))


@blueprint.post("/api/generate")
async def generate() -> Any:
    body = await parse_body(GenerateRequest)
    for unsupported in ("template", "suffix"):
        if getattr(body, unsupported):
            raise InvalidRequest(
                f"'{unsupported}' is not supported: mlxd renders prompts with the model's own "
                "chat template (send 'raw': true with a fully templated prompt instead)",
                param=unsupported,
            )
    if body.context:
        raise InvalidRequest(
            "'context' is not supported: keep the conversation with /api/chat", param="context"
        )
    model, timing = body.model, Timing()
    keep = _keep_alive(model, body.keep_alive)
    if not body.prompt and not body.images:
        return {**await _load_or_unload(body, model, keep), "response": ""}
    entry, engine = await generation_engine(model)
    timing.loaded = time.monotonic_ns()
    if body.raw:
        if body.images:
            raise InvalidRequest("images need a templated prompt (raw: false)", param="images")
        prompt: dict[str, Any] = {"prompt": body.prompt}
    else:
        messages = [Message(role="user", content=body.prompt, images=body.images)]
        if body.system:
            messages.insert(0, Message(role="system", content=body.system))
        prompt = {"messages": [internal_message(m, i) for i, m in enumerate(messages)]}
    parts = await start(entry, engine, sampling_request(body, entry, **prompt))
    chunks = message_chunks(parts, timing, think=body.think is not False)

    def render(chunk: dict[str, Any]) -> dict[str, Any]:
        out = {"response": chunk.get("content", "")}
        if chunk.get("thinking"):
            out["thinking"] = chunk["thinking"]
        return {**out, **{k: v for k, v in chunk.items() if k not in ("content", "thinking")}}

    head = {"model": body.model, "created_at": iso_time()}
    return await _respond(head, chunks, render, body.stream, _unload_if_asked(model, keep))


@blueprint.post("/api/embed")
async def embed() -> Any:
    body = await parse_body(EmbedRequest)
    model, started = body.model, time.monotonic_ns()
    keep = _keep_alive(model, body.keep_alive)
    inputs = [body.input] if isinstance(body.input, str) else body.input
    result, loaded = await embed_texts(
        model, inputs, dimensions=body.dimensions, truncate=body.truncate, param="input"
    )
    await _unload_if_asked(model, keep)()
    return {
        "model": body.model,
        "embeddings": [vector.tolist() for vector in result.vectors],
        "total_duration": time.monotonic_ns() - started,
        "load_duration": loaded - started,
        "prompt_eval_count": result.prompt_tokens,
    }


@blueprint.post("/api/embeddings")
async def embeddings_legacy() -> Any:
    body = await parse_body(EmbeddingsRequest)
    model = body.model
    keep = _keep_alive(model, body.keep_alive)
    result, _ = await embed_texts(model, [body.prompt], param="prompt")
    await _unload_if_asked(model, keep)()
    return {"embedding": result.vectors[0].tolist()}
