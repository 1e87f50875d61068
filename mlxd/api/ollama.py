"""Ollama dialect: /api/chat, /api/generate, /api/embed(dings), /api/tags, /api/ps, /api/show,
/api/version, and a clear 501 for the model-management routes (models live in the YAML).

Requests become the same `GenerationRequest` as every other dialect's and go through
`generation.start`; answers are rendered from the one parsed part stream. A streamed answer
is NDJSON (Ollama's default); `stream: false` folds the very same chunks into one object, so
both agree by construction. Errors are Ollama's `{"error": "message"}` (see app._render).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from quart import Blueprint, current_app, make_response

from mlxd.api import auth, embeddings
from mlxd.api.generation import (
    Logprobs,
    Part,
    generation_engine,
    new_id,
    parse_body,
    sampling_params,
    start,
)
from mlxd.api.ollama_render import (
    OLLAMA_VERSION,
    fold,
    iso_time,
    model_details,
    parse_arguments,
)
from mlxd.api.protocol.ollama import (
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    Message,
    ShowRequest,
    keep_alive_seconds,
)
from mlxd.errors import InvalidRequest, MlxdError
from mlxd.parsers.base import ReasoningPart, TextPart, ToolCallArgs, ToolCallEnd, ToolCallStart
from mlxd.registry.routes import ModelEntry
from mlxd.types import Finished, GenerationRequest

blueprint = Blueprint("ollama", __name__)

NDJSON = "application/x-ndjson"


class NotImplementedHere(MlxdError):
    status = 501
    kind = "not_implemented"


def model_id(requested: str) -> str:
    """The mlxd id an Ollama client means: Ollama names carry a tag (`smol:latest`); a
    `:latest` on a known id is dropped. Unknown ids stay as sent (the route's 404)."""
    ids = current_app.daemon.routes.ids
    if requested not in ids and requested.endswith(":latest"):
        bare = requested.removesuffix(":latest")
        if bare in ids:
            return bare
    return requested


def _keep_alive(model: str, value: Any) -> float | None:
    """Apply a request's keep_alive to its model (through the daemon, never the YAML);
    returns it in seconds, 0 meaning "unload once this request is done"."""
    try:
        seconds = keep_alive_seconds(value)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="keep_alive") from None
    if seconds:  # 0 is applied after the request: unload
        current_app.daemon.set_keep_alive(model, seconds)
    return seconds


async def _unload_if_asked(model: str, seconds: float | None) -> None:
    if seconds == 0:
        await current_app.daemon.unload_model(model)


@dataclass
class Timing:
    """Ollama's durations, in nanoseconds: load (waiting for the model), prompt evaluation
    (submission to first token) and evaluation (first token to the end)."""

    started: int = field(default_factory=time.monotonic_ns)
    loaded: int = 0
    first_token: int = 0

    def stats(self, finished: Finished) -> dict[str, Any]:
        now = time.monotonic_ns()
        loaded = self.loaded or self.started
        first = self.first_token or now
        return {
            "total_duration": now - self.started,
            "load_duration": loaded - self.started,
            "prompt_eval_count": finished.prompt_tokens,
            "prompt_eval_duration": first - loaded,
            "eval_count": finished.completion_tokens,
            "eval_duration": now - first,
        }


def _sampling_request(
    body: ChatRequest | GenerateRequest, entry: ModelEntry, **prompt: Any
) -> GenerationRequest:
    options, defaults = body.options, entry.config.defaults
    # num_predict < 0 means "until the context is full" in Ollama; here the model's default.
    max_tokens = options.num_predict if options.num_predict and options.num_predict > 0 else None
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return GenerationRequest(
        request_id=new_id(""),
        model=entry.name,
        max_tokens=max_tokens or defaults.max_tokens,
        sampling=sampling_params(
            defaults,
            temperature=options.temperature,
            top_p=options.top_p,
            top_k=options.top_k,
            min_p=options.min_p,
            seed=options.seed,
            repetition_penalty=options.repeat_penalty,
            presence_penalty=options.presence_penalty,
            frequency_penalty=options.frequency_penalty,
            top_logprobs=top_logprobs,
        ),
        stop=options.stop or [],
        response_format=_response_format(body.format),
        **prompt,
    )


def _response_format(value: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """`format: "json"` or a JSON schema, through the constrained decoder."""
    if not value:
        return None
    if value == "json":
        return {"type": "json_object"}
    return {"type": "json_schema", "schema": value}


def internal_message(message: Message, index: int) -> dict[str, Any]:
    """One Ollama message as the internal (OpenAI-shaped) message: images become the same
    `image_url` parts the OpenAI route makes (base64 → data: URL), tool calls carry their
    arguments object (templates want a mapping), a tool result names its tool."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.images:
        out["content"] = [
            *(
                {
                    "type": "image_url",
                    "image_url": {"url": _data_url(image)},
                    "param": f"messages[{index}].images[{j}]",
                }
                for j, image in enumerate(message.images)
            ),
            {"type": "text", "text": message.content},
        ]
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": f"call_{index}_{j}",
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for j, c in enumerate(message.tool_calls)
        ]
    if message.role == "tool" and message.tool_name:
        out["name"] = message.tool_name
    return out


def _data_url(image: str) -> str:
    # Ollama sends bare base64; some clients send a data: URL already.
    return image if image.startswith("data:") else f"data:image;base64,{image}"


async def message_chunks(
    parts: AsyncIterator[Part], timing: Timing, *, think: bool
) -> AsyncIterator[dict[str, Any]]:
    """The parsed parts as Ollama message deltas: `content`, `thinking`, complete
    `tool_calls` (Ollama sends each call whole, arguments as an object), `logprobs`; then
    the final stats (a `Finished` becomes `done: true` and the durations)."""
    call: dict[str, Any] | None = None
    async with aclosing(parts):
        async for part in parts:
            if not timing.first_token and not isinstance(part, Finished):
                timing.first_token = time.monotonic_ns()
            if isinstance(part, TextPart) and part.text:
                yield {"content": part.text}
            elif isinstance(part, ReasoningPart) and part.text and think:
                yield {"thinking": part.text}
            elif isinstance(part, ToolCallStart):
                call = {"id": part.id, "name": part.name, "arguments": ""}
            elif isinstance(part, ToolCallArgs) and call is not None:
                call["arguments"] += part.fragment
            elif isinstance(part, ToolCallEnd) and call is not None:
                yield {"tool_calls": [_ollama_call(call)]}
                call = None
            elif isinstance(part, Logprobs):
                yield {"logprobs": [_logprob(item) for item in part.items]}
            elif isinstance(part, Finished):
                if call is not None:  # cut off mid-call (max tokens): what was said so far
                    yield {"tool_calls": [_ollama_call(call)]}
                reason = "length" if part.reason == "length" else "stop"
                yield {"done": True, "done_reason": reason, **timing.stats(part)}


def _ollama_call(call: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": call["id"],
        "function": {"name": call["name"], "arguments": parse_arguments(call["arguments"])},
    }


def _logprob(item: Any) -> dict[str, Any]:
    return {
        "token": item.token,
        "logprob": item.logprob,
        "top_logprobs": [{"token": t, "logprob": lp} for t, lp in item.top],
    }


async def _respond(
    head: dict[str, Any],
    chunks: AsyncIterator[dict[str, Any]],
    render: Any,
    stream: bool,
    after: Any,
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

    response = await make_response(lines(), 200, {"Content-Type": NDJSON})
    response.timeout = None
    return response


def _line(payload: dict[str, Any]) -> bytes:
    return (json.dumps(payload, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


async def _load_or_unload(body: ChatRequest | GenerateRequest, model: str, keep: float | None):
    """Ollama's empty request: load the model (or with keep_alive 0 unload it); no text."""
    if keep == 0:
        await current_app.daemon.unload_model(model)
        reason = "unload"
    else:
        await current_app.daemon.load_model(model)
        reason = "load"
    return {"model": body.model, "created_at": iso_time(), "done": True, "done_reason": reason}


@blueprint.post("/api/chat")
async def chat() -> Any:
    body = await parse_body(ChatRequest)
    model, timing = model_id(body.model), Timing()
    keep = _keep_alive(model, body.keep_alive)
    if not body.messages:
        empty = await _load_or_unload(body, model, keep)
        return {**empty, "message": {"role": "assistant", "content": ""}}
    entry, engine = await generation_engine(model)
    timing.loaded = time.monotonic_ns()
    generation = _sampling_request(
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
    return await _respond(head, chunks, render, body.stream, lambda: _unload_if_asked(model, keep))


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
    model, timing = model_id(body.model), Timing()
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
    parts = await start(entry, engine, _sampling_request(body, entry, **prompt))
    chunks = message_chunks(parts, timing, think=body.think is not False)

    def render(chunk: dict[str, Any]) -> dict[str, Any]:
        out = {"response": chunk.get("content", "")}
        if chunk.get("thinking"):
            out["thinking"] = chunk["thinking"]
        return {**out, **{k: v for k, v in chunk.items() if k not in ("content", "thinking")}}

    head = {"model": body.model, "created_at": iso_time()}
    return await _respond(head, chunks, render, body.stream, lambda: _unload_if_asked(model, keep))


@blueprint.post("/api/embed")
async def embed() -> Any:
    body = await parse_body(EmbedRequest)
    model, started = model_id(body.model), time.monotonic_ns()
    keep = _keep_alive(model, body.keep_alive)
    inputs = [body.input] if isinstance(body.input, str) else body.input
    result, loaded = await embeddings.embed_texts(
        model, inputs, dimensions=body.dimensions, truncate=body.truncate, param="input"
    )
    await _unload_if_asked(model, keep)
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
    model = model_id(body.model)
    keep = _keep_alive(model, body.keep_alive)
    result, _ = await embeddings.embed_texts(model, [body.prompt], param="prompt")
    await _unload_if_asked(model, keep)
    return {"embedding": result.vectors[0].tolist()}


@blueprint.get("/api/tags")
async def tags() -> Any:
    """Every declared model the caller may use, named as Ollama names them (`name:latest`)."""
    daemon, caller = current_app.daemon, auth.caller()
    models = []
    for name, entry in daemon.routes.models.items():
        if caller.may_use(name):
            models.append(_model_row(name, entry))
    return {"models": models}


@blueprint.get("/api/ps")
async def ps() -> Any:
    """The loaded models, with when they unload if left idle."""
    daemon, caller = current_app.daemon, auth.caller()
    status = daemon.reconciler.status()
    models = []
    for name, entry in daemon.routes.models.items():
        row = status.get(name, {})
        if not caller.may_use(name) or row.get("state") != "loaded":
            continue
        ttl = row.get("idle_ttl_s")
        remaining = math.inf if ttl is None else max(ttl - row.get("idle_s", 0.0), 0.0)
        models.append(
            {
                **_model_row(name, entry),
                "expires_at": iso_time(time.time() + min(remaining, 100 * 365 * 86400)),
                "size_vram": 0,  # MLX on the CPU; unified memory on Apple silicon
                "context_length": row.get("context_length"),
            }
        )
    return {"models": models}


def _model_row(name: str, entry: ModelEntry) -> dict[str, Any]:
    tagged = name if ":" in name else f"{name}:latest"
    engine = entry.engine
    return {
        "name": tagged,
        "model": tagged,
        "modified_at": iso_time(current_app.daemon.config.loaded_at or time.time()),
        "size": getattr(engine, "memory_bytes", 0) if engine is not None else 0,
        "digest": hashlib.sha256(f"{name}\0{entry.config.source}".encode()).hexdigest(),
        "details": model_details(entry),
    }


@blueprint.post("/api/show")
async def show() -> Any:
    body = await parse_body(ShowRequest)
    requested = body.model or body.name
    if not requested:
        raise InvalidRequest("model is required", param="model")
    model = model_id(requested)
    entry = current_app.daemon.routes.entry(model)
    config, engine = entry.config, entry.engine
    stats = engine.stats() if engine is not None else {}
    capabilities = {
        "llm": ["completion", "tools"],
        "vlm": ["completion", "tools", "vision"],
        "embedding": ["embedding"],
    }[config.kind]
    if config.parsers.reasoning:
        capabilities.append("thinking")
    details = model_details(entry)
    info: dict[str, Any] = {"general.architecture": details["family"]}
    if stats.get("context_length"):
        info[f"{details['family']}.context_length"] = stats["context_length"]
    defaults = config.defaults
    parameters = "\n".join(
        f"{key:<30} {value}"
        for key, value in (
            ("num_predict", defaults.max_tokens),
            ("temperature", defaults.temperature),
            ("top_p", defaults.top_p),
            ("top_k", defaults.top_k),
        )
    )
    return {
        "modelfile": f"# {requested} is declared in mlxd's YAML config\nFROM {config.source}\n",
        "parameters": parameters,
        "template": getattr(engine, "chat_template", None) or "",
        "details": details,
        "model_info": info,
        "capabilities": capabilities,
        "modified_at": iso_time(current_app.daemon.config.loaded_at or time.time()),
    }


@blueprint.get("/api/version")
async def version() -> Any:
    return {"version": OLLAMA_VERSION}


@blueprint.route("/api/pull", methods=["POST"])
@blueprint.route("/api/push", methods=["POST"])
@blueprint.route("/api/create", methods=["POST"])
@blueprint.route("/api/copy", methods=["POST"])
@blueprint.route("/api/delete", methods=["DELETE", "POST"])
async def manage() -> Any:
    raise NotImplementedHere(
        "mlxd does not pull, push, create, copy or delete models: models are declared in "
        "mlxd's YAML config file (models: ...); edit it and mlxd reloads it"
    )
