"""OpenAI dialect: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

from quart import Blueprint

from mlxd.api.common.context import current_app
from mlxd.api.common.error_shapes import openai_error
from mlxd.api.common.generation import (
    constrained_output,
    event_stream,
    generation_engine,
    new_id,
    parse_body,
    refuse_unhonoured,
    sampling_params,
    template_kwargs,
    tool_choice,
)
from mlxd.api.common.parts import Completion, Logprobs, Part
from mlxd.api.common.sequences import Interleaved, collect_all, copies, start_many, total_usage
from mlxd.api.middleware import auth
from mlxd.api.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from mlxd.control.routes import ModelEntry
from mlxd.errors import InvalidRequest, MlxdError
from mlxd.parsers.base import ReasoningPart, TextPart, ToolCallArgs, ToolCallStart
from mlxd.types import Finished, GenerationRequest, TokenLogprob

blueprint = Blueprint("openai", __name__)


def _generation_request(
    body: SamplingFields, top_logprobs: int | None, **prompt: Any
) -> tuple[str, GenerationRequest]:
    """Route `body.model` and build the internal request; returns (model id, request)."""
    refuse_unhonoured(body)
    entry = current_app.daemon.routes.entry(body.model, auth.caller())
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
        stop=cast(list[str], body.stop or []),  # a list: the field's validator makes it one
        chat_template_kwargs=template_kwargs(entry, requested_kwargs),
        **prompt,
    )
    return body.model, generation


async def _start(
    model_id: str, generations: list[GenerationRequest], n: int, *, parse: bool = True
) -> Interleaved:
    entry, engine = await generation_engine(model_id)
    return await start_many(entry, engine, generations, per_prompt=n, parse=parse)


def _tool_choice(body: ChatCompletionRequest) -> str | dict[str, Any] | None:
    """OpenAI's tool_choice in the internal form; a named tool must be one of `tools`."""
    choice = body.tool_choice
    names = {t.get("function", {}).get("name") for t in body.tools or []}
    if isinstance(choice, dict):
        return tool_choice(None, (choice.get("function") or {}).get("name") or "", names)
    return tool_choice(choice, None, names)


def _response_format(body: ChatCompletionRequest) -> dict[str, Any] | None:
    response_format = body.response_format
    if response_format is None:
        return None
    spec = response_format.json_schema or {}
    return constrained_output(
        response_format.type, spec.get("schema"), "response_format", "json_schema.schema"
    )


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
    streams = await _start(model_id, copies(generation, body.n), body.n)
    head = {"id": new_id("chatcmpl-"), "created": int(time.time()), "model": model_id}

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        openings = [
            {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for index in range(body.n)
        ]
        head = {**head, "object": "chat.completion.chunk"}
        chunks = _stream(streams, head, include_usage, _chat_choices, body.n, openings)
        return await event_stream(chunks)

    results = await collect_all(streams, body.n)
    return {
        **head,
        "object": "chat.completion",
        "choices": [_chat_choice(index, result, top) for index, result in enumerate(results)],
        "usage": total_usage([_finished(r) for r in results], body.n),
    }


def _finished(result: Completion) -> Finished:
    assert result.finished is not None  # every sequence's parts end with its Finished
    return result.finished


def _chat_choice(index: int, result: Completion, top: int | None) -> dict[str, Any]:
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
    return {
        "index": index,
        "message": message,
        "logprobs": _chat_logprobs(result.logprobs) if top is not None else None,
        "finish_reason": _finish_reason(_finished(result), bool(result.tool_calls)),
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
    if body.suffix:
        raise InvalidRequest("suffix is not supported", param="suffix")
    prompts = body.prompts()
    if body.echo and any(not isinstance(p, str) for p in prompts):
        raise InvalidRequest("echo needs text prompts, not token ids", param="echo")
    if body.echo and body.logprobs is not None:
        # OpenAI would score the prompt's tokens too; mlxd has only the completion's.
        raise InvalidRequest("echo with logprobs is not supported", param="echo")
    generations = []
    for prompt in prompts:
        model_id, generation = _generation_request(body, body.logprobs, prompt=prompt)
        generations.extend(copies(generation, body.n))
    streams = await _start(model_id, generations, body.n, parse=False)
    # Choice i answers prompt i // n (OpenAI's order: every choice of a prompt together).
    echoes = [p if body.echo and isinstance(p, str) else "" for p in prompts for _ in range(body.n)]
    head = {"id": new_id("cmpl-"), "created": int(time.time()), "model": model_id}

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        openings = [
            {"index": i, "text": echo, "logprobs": None, "finish_reason": None}
            for i, echo in enumerate(echoes)
            if echo
        ]
        chunks = _stream(
            streams,
            {**head, "object": "text_completion"},
            include_usage,
            lambda: _completion_choice,
            body.n,
            openings,
        )
        return await event_stream(chunks)

    results = await collect_all(streams, len(generations))
    choices = [
        {
            "index": index,
            "text": echoes[index] + result.text,
            "logprobs": (
                _completion_logprobs(result.logprobs) if body.logprobs is not None else None
            ),
            "finish_reason": _finished(result).reason,
        }
        for index, result in enumerate(results)
    ]
    return {
        **head,
        "object": "text_completion",
        "choices": choices,
        "usage": total_usage([_finished(r) for r in results], body.n),
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
    streams: Interleaved,
    head: dict,
    include_usage: bool,
    choices: Callable[[], Callable[[Part], dict | None]],
    per_prompt: int,
    openings: list[dict],
) -> AsyncIterator[bytes]:
    """OpenAI's SSE framing, shared by chat and text completions: the opening chunks, one
    chunk per part of any sequence (its choice index set), the usage chunk when asked for,
    then `[DONE]`. A failure after the headers went out becomes an error event (and every
    sequence is cancelled, as when the client leaves)."""
    extra = {"usage": None} if include_usage else {}
    for opening in openings:
        yield sse({**head, "choices": [opening], **extra})
    renderers: dict[int, Callable[[Part], dict | None]] = {}
    finished: dict[int, Finished] = {}
    try:
        async for index, part in streams:
            rendered = renderers.setdefault(index, choices())(part)
            if rendered is not None:
                yield sse({**head, "choices": [{**rendered, "index": index}], **extra})
            if isinstance(part, Finished):
                finished[index] = part
    except MlxdError as exc:
        yield sse(openai_error(exc))
    else:
        if include_usage:
            ordered = [finished[i] for i in sorted(finished)]
            yield sse({**head, "choices": [], "usage": total_usage(ordered, per_prompt)})
    finally:
        # Now, not when the collector reaches the iterator: a response closed early (the
        # client left or was cut off) cancels its sequences and logs its line at once.
        await streams.aclose()
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
    return _model_card(model_id, current_app.daemon.routes.entry(model_id, auth.caller()))


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


def sse(payload: dict) -> bytes:
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
