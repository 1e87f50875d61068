"""OpenAI dialect: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from quart import Blueprint, current_app

from mlxd.api import auth
from mlxd.api.errors import openai_error
from mlxd.api.generation import (
    Logprobs,
    Part,
    collect,
    event_stream,
    generation_engine,
    new_id,
    parse_body,
    refuse_unhonoured,
    sampling_params,
    start,
    template_kwargs,
    usage,
)
from mlxd.api.protocol.openai import ChatCompletionRequest, CompletionRequest, SamplingFields
from mlxd.errors import InvalidRequest, MlxdError
from mlxd.parsers.base import ReasoningPart, TextPart, ToolCallArgs, ToolCallStart
from mlxd.registry.routes import ModelEntry
from mlxd.types import Finished, GenerationRequest, TokenLogprob

blueprint = Blueprint("openai", __name__)


def _generation_request(
    body: SamplingFields, top_logprobs: int | None, **prompt: Any
) -> tuple[str, GenerationRequest]:
    """Route `body.model` and build the internal request; returns (model id, request)."""
    refuse_unhonoured(body)
    entry = current_app.daemon.routes.entry(body.model)
    defaults = entry.config.defaults
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    requested_kwargs = getattr(body, "chat_template_kwargs", None)
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
            repetition_context_size=body.repetition_context_size,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logit_bias=body.logit_bias,
            top_logprobs=top_logprobs,
        ),
        stop=body.stop or [],
        chat_template_kwargs=template_kwargs(entry, requested_kwargs),
        **prompt,
    )
    return body.model, generation


async def _start(
    model_id: str, generation: GenerationRequest, *, parse: bool = True
) -> AsyncIterator[Part]:
    entry, engine = await generation_engine(model_id)
    return await start(entry, engine, generation, parse=parse)


def _tool_choice(body: ChatCompletionRequest) -> str | dict[str, Any] | None:
    """OpenAI's tool_choice in the internal form; a named tool must be one of `tools`."""
    choice = body.tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        names = {t.get("function", {}).get("name") for t in body.tools or []}
        if name not in names:
            raise InvalidRequest(
                f"tool_choice names '{name}', which is not in tools", param="tool_choice"
            )
        return {"name": name}
    if choice == "required" and not body.tools:
        raise InvalidRequest("tool_choice 'required' needs tools", param="tool_choice")
    return choice


def _response_format(body: ChatCompletionRequest) -> dict[str, Any] | None:
    response_format = body.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "json_object"}
    spec = response_format.json_schema or {}
    if not isinstance(spec.get("schema"), dict):
        raise InvalidRequest(
            "response_format json_schema needs json_schema.schema", param="response_format"
        )
    return {"type": "json_schema", "schema": spec["schema"]}


@blueprint.post("/v1/chat/completions")
async def chat_completions() -> Any:
    body = await parse_body(ChatCompletionRequest)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs: true", param="top_logprobs")
    top = (body.top_logprobs or 0) if body.logprobs else None
    tool_choice = _tool_choice(body)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    model_id, generation = _generation_request(
        body,
        top,
        messages=messages,
        # "none" keeps tools out of the prompt altogether, so none can be called.
        tools=None if tool_choice == "none" else body.tools,
        tool_choice=tool_choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body),
    )
    parts = await _start(model_id, generation)
    head = {"id": new_id("chatcmpl-"), "created": int(time.time()), "model": model_id}

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        opening = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        head = {**head, "object": "chat.completion.chunk"}
        chunks = _stream(parts, head, include_usage, _chat_choices(), opening)
        return await event_stream(chunks)

    result = await collect(parts)
    message: dict[str, Any] = {"role": "assistant", "content": result.text or None}
    if result.reasoning:
        message.update(_reasoning(result.reasoning))
    if result.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in result.tool_calls
        ]
    elif message["content"] is None:
        message["content"] = ""
    choice = {
        "index": 0,
        "message": message,
        "logprobs": _chat_logprobs(result.logprobs) if top is not None else None,
        "finish_reason": _finish_reason(result.finished, bool(result.tool_calls)),
    }
    return {
        **head,
        "object": "chat.completion",
        "choices": [choice],
        "usage": usage(result.finished),
    }


def _reasoning(text: str) -> dict[str, str]:
    """Reasoning under both names clients read: `reasoning_content` (DeepSeek, vLLM until
    0.10, most SDK wrappers) and `reasoning` (vLLM since, vllm-mlx, OpenRouter)."""
    return {"reasoning_content": text, "reasoning": text}


def _finish_reason(finished: Finished, called_tools: bool) -> str:
    return "tool_calls" if called_tools and finished.reason == "stop" else finished.reason


def _chat_choices() -> Callable[[Part], dict[str, Any] | None]:
    """Maps one response's parts to chunk choices (remembering whether a tool was called)."""
    called = False

    def choice(part: Part) -> dict[str, Any] | None:
        nonlocal called
        delta: dict[str, Any] = {}
        logprobs = finish = None
        if isinstance(part, TextPart):
            delta = {"content": part.text}
        elif isinstance(part, ReasoningPart):
            delta = _reasoning(part.text)
        elif isinstance(part, ToolCallStart):
            called = True
            delta = {
                "tool_calls": [
                    {
                        "index": part.index,
                        "id": part.id,
                        "type": "function",
                        "function": {"name": part.name, "arguments": ""},
                    }
                ]
            }
        elif isinstance(part, ToolCallArgs):
            delta = {
                "tool_calls": [{"index": part.index, "function": {"arguments": part.fragment}}]
            }
        elif isinstance(part, Logprobs):
            logprobs = _chat_logprobs(part.items)
        elif isinstance(part, Finished):
            finish = _finish_reason(part, called)
        else:
            return None  # ToolCallEnd: OpenAI has no chunk for it
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    return choice


@blueprint.post("/v1/completions")
async def completions() -> Any:
    body = await parse_body(CompletionRequest)
    if body.echo or body.suffix:
        raise InvalidRequest("echo and suffix are not supported", param="echo")
    model_id, generation = _generation_request(body, body.logprobs, prompt=body.prompt)
    parts = await _start(model_id, generation, parse=False)
    head = {"id": new_id("cmpl-"), "created": int(time.time()), "model": model_id}

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _stream(
            parts, {**head, "object": "text_completion"}, include_usage, _completion_choice
        )
        return await event_stream(chunks)

    result = await collect(parts)
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


def _completion_choice(part: Part) -> dict[str, Any] | None:
    if isinstance(part, TextPart):
        return {"index": 0, "text": part.text, "logprobs": None, "finish_reason": None}
    if isinstance(part, Logprobs):
        logprobs = _completion_logprobs(part.items)
        return {"index": 0, "text": "", "logprobs": logprobs, "finish_reason": None}
    if isinstance(part, Finished):
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": part.reason}
    return None


async def _stream(
    parts: AsyncIterator[Part],
    head: dict,
    include_usage: bool,
    choice: Callable[[Part], dict | None],
    opening: dict | None = None,
) -> AsyncIterator[bytes]:
    """OpenAI's SSE framing, shared by chat and text completions: one chunk per part, the
    usage chunk when asked for, then `[DONE]`. A failure after the headers went out becomes
    an error event."""
    extra = {"usage": None} if include_usage else {}
    if opening is not None:
        yield _sse({**head, "choices": [opening], **extra})
    try:
        async for part in parts:
            rendered = choice(part)
            if rendered is not None:
                yield _sse({**head, "choices": [rendered], **extra})
            if isinstance(part, Finished) and include_usage:
                yield _sse({**head, "choices": [], "usage": usage(part)})
    except MlxdError as exc:
        yield _sse(openai_error(exc))
    yield b"data: [DONE]\n\n"


@blueprint.get("/v1/models")
async def list_models() -> Any:
    routes, caller = current_app.daemon.routes, auth.caller()
    data = [
        _model_card(model_id, routes.models[name])
        for model_id, name in routes.ids.items()
        if caller.may_use(name)
    ]
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
