"""OpenAI dialect: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from quart import Blueprint, current_app

from mlxd.api.errors import openai_error
from mlxd.api.generation import (
    collect,
    event_stream,
    new_id,
    parse_body,
    raise_if_failed,
    sampling_params,
    usage,
)
from mlxd.api.protocol.openai import ChatCompletionRequest, CompletionRequest, SamplingFields
from mlxd.engines.base import Delta, Event, Finished, GenerationRequest, TokenLogprob
from mlxd.errors import InvalidRequest, MlxdError
from mlxd.registry.routes import ModelEntry

blueprint = Blueprint("openai", __name__)


def _generation_request(
    body: SamplingFields, top_logprobs: int | None, **prompt: Any
) -> tuple[str, GenerationRequest]:
    """Route `body.model` and build the internal request; returns (model id, request)."""
    entry = current_app.daemon.routes.entry(body.model)
    defaults = entry.config.defaults
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    generation = GenerationRequest(
        request_id=new_id(""),
        model=entry.name,
        max_tokens=max_tokens or defaults.max_tokens,
        sampling=sampling_params(
            defaults,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            seed=body.seed,
            repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logit_bias=body.logit_bias,
            top_logprobs=top_logprobs,
        ),
        stop=body.stop or [],
        **prompt,
    )
    return body.model, generation


async def _submit(model_id: str, generation: GenerationRequest) -> AsyncIterator[Event]:
    engine = await current_app.daemon.engine(model_id)
    return await engine.submit(generation)


@blueprint.post("/v1/chat/completions")
async def chat_completions() -> Any:
    body = await parse_body(ChatCompletionRequest)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs: true", param="top_logprobs")
    if body.response_format is not None and body.response_format.type != "text":
        raise InvalidRequest(
            f"response_format '{body.response_format.type}' is not supported yet",
            param="response_format",
        )
    top = (body.top_logprobs or 0) if body.logprobs else None
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    model_id, generation = _generation_request(body, top, messages=messages, tools=body.tools)
    events = await _submit(model_id, generation)
    response_id, created = new_id("chatcmpl-"), int(time.time())
    head = {"id": response_id, "created": created, "model": model_id}

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        opening = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        chunks = _stream(
            events,
            {**head, "object": "chat.completion.chunk"},
            include_usage,
            _chat_choice,
            opening,
        )
        return await event_stream(chunks)

    result = await collect(events)
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": result.text},
        "logprobs": _chat_logprobs(result.logprobs) if top is not None else None,
        "finish_reason": result.finished.reason,
    }
    return {
        **head,
        "object": "chat.completion",
        "choices": [choice],
        "usage": usage(result.finished),
    }


def _chat_choice(event: Event) -> dict[str, Any]:
    if isinstance(event, Delta):
        logprobs = _chat_logprobs(event.logprobs) if event.logprobs else None
        return {
            "index": 0,
            "delta": {"content": event.text},
            "logprobs": logprobs,
            "finish_reason": None,
        }
    return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": event.reason}


@blueprint.post("/v1/completions")
async def completions() -> Any:
    body = await parse_body(CompletionRequest)
    if body.echo or body.suffix:
        raise InvalidRequest("echo and suffix are not supported", param="echo")
    model_id, generation = _generation_request(body, body.logprobs, prompt=body.prompt)
    events = await _submit(model_id, generation)
    head = {"id": new_id("cmpl-"), "created": int(time.time()), "model": model_id}

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _stream(
            events, {**head, "object": "text_completion"}, include_usage, _completion_choice
        )
        return await event_stream(chunks)

    result = await collect(events)
    choice = {
        "index": 0,
        "text": result.text,
        "logprobs": _completion_logprobs(result.logprobs) if body.logprobs is not None else None,
        "finish_reason": result.finished.reason,
    }
    return {
        **head,
        "object": "text_completion",
        "choices": [choice],
        "usage": usage(result.finished),
    }


def _completion_choice(event: Event) -> dict[str, Any]:
    if isinstance(event, Delta):
        logprobs = _completion_logprobs(event.logprobs) if event.logprobs else None
        return {"index": 0, "text": event.text, "logprobs": logprobs, "finish_reason": None}
    return {"index": 0, "text": "", "logprobs": None, "finish_reason": event.reason}


async def _stream(
    events: AsyncIterator[Event],
    head: dict,
    include_usage: bool,
    choice: Callable[[Event], dict],
    opening: dict | None = None,
) -> AsyncIterator[bytes]:
    """OpenAI's SSE framing, shared by chat and text completions: one chunk per event, the
    usage chunk when asked for, then `[DONE]`."""
    extra = {"usage": None} if include_usage else {}
    if opening is not None:
        yield _sse({**head, "choices": [opening], **extra})
    async for event in _guarded(events):
        if isinstance(event, bytes):
            yield event
            continue
        yield _sse({**head, "choices": [choice(event)], **extra})
        if isinstance(event, Finished) and include_usage:
            yield _sse({**head, "choices": [], "usage": usage(event)})
    yield b"data: [DONE]\n\n"


async def _guarded(events: AsyncIterator[Event]) -> AsyncIterator[Event | bytes]:
    """Events, with a failure after the headers went out turned into an OpenAI error event."""
    try:
        async for event in events:
            if isinstance(event, Finished):
                raise_if_failed(event)
            yield event
    except MlxdError as exc:
        yield _sse(openai_error(exc))


@blueprint.get("/v1/models")
async def list_models() -> Any:
    routes = current_app.daemon.routes
    data = [_model_card(model_id, routes.models[name]) for model_id, name in routes.ids.items()]
    return {"object": "list", "data": data}


@blueprint.get("/v1/models/<path:model_id>")
async def get_model(model_id: str) -> Any:
    return _model_card(model_id, current_app.daemon.routes.entry(model_id))


def _model_card(model_id: str, entry: ModelEntry) -> dict[str, Any]:
    """OpenAI's model object, plus mlxd's own view: the model behind an alias and its state."""
    return {
        "id": model_id,
        "object": "model",
        "created": int(current_app.daemon.started_at),
        "owned_by": "mlxd",
        "root": entry.name,
        "kind": entry.config.kind,
        "aliases": list(entry.config.aliases),
        "state": entry.state,
    }


def _sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def _top(item: tuple[str, float]) -> dict:
    token, logprob = item
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def _chat_logprobs(items: list[TokenLogprob]) -> dict:
    return {
        "content": [
            {**_top((i.token, i.logprob)), "top_logprobs": [_top(t) for t in i.top]} for i in items
        ]
    }


def _completion_logprobs(items: list[TokenLogprob]) -> dict:
    return {
        "tokens": [i.token for i in items],
        "token_logprobs": [i.logprob for i in items],
        "top_logprobs": [dict(i.top) for i in items],
    }
