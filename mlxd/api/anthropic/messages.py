"""Anthropic dialect: /v1/messages, /v1/messages/count_tokens and /v1/messages/batch.

Requests become the same `GenerationRequest` as the OpenAI routes' and answers are rendered
from the same parsed parts. Both responses are built from one sequence of Anthropic stream
events, so a streamed and a non-streamed answer agree by construction. The `x-api-key` header
Anthropic clients send is checked by `auth`; `anthropic-version` and `anthropic-beta` change
nothing (every beta field mlxd knows is accepted without its header).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Iterable
from typing import Any

from pydantic import ValidationError
from quart import Blueprint, request

from mlxd.api.anthropic.errors import anthropic_error
from mlxd.api.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    prompt_fields,
)
from mlxd.api.common.error_shapes import from_validation_error
from mlxd.api.common.generation import (
    event_stream,
    generation_engine,
    new_id,
    parse_body,
    sampling_params,
    start,
    template_kwargs,
)
from mlxd.api.common.parts import Part
from mlxd.api.middleware import ratelimit
from mlxd.control.routes import ModelEntry
from mlxd.errors import InvalidRequest, MlxdError
from mlxd.parsers.base import ReasoningPart, TextPart, ToolCallArgs, ToolCallEnd, ToolCallStart
from mlxd.types import Finished, GenerationRequest

blueprint = Blueprint("anthropic", __name__)

# Proxies and clients drop connections that stay silent; prefilling a long prompt can.
PING_INTERVAL_S = 10.0
PING = {"type": "ping"}
# /v1/messages/batch: how many of one request's messages are in the engines at once.
BATCH_CONCURRENCY = 16
BATCH_MAX_REQUESTS = 1000


def _generation(body: MessagesRequest, entry: ModelEntry, priority: int = 0) -> GenerationRequest:
    return GenerationRequest(
        request_id=new_id(""),
        model=entry.name,
        max_tokens=max(body.max_tokens, 1),  # 0 (cache pre-warm): one token, not sent
        sampling=sampling_params(
            entry.config.defaults, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k
        ),
        stop=body.stop_sequences or [],
        priority=priority,
        chat_template_kwargs=template_kwargs(entry),
        response_format=body.response_format(),
        **prompt_fields(body),
    )


async def _begin(body: MessagesRequest, priority: int = 0) -> tuple[AsyncIterable[Part], int]:
    """Submit `body`; its parsed parts, and its prompt's size (a stream reports it in
    message_start, before the first token exists). A prefill that opens a think block is seen
    by the engine (`admission.reasoning_open`): the answer then starts in the reasoning."""
    entry, engine = await generation_engine(body.model)
    parts = await start(entry, engine, _generation(body, entry, priority))
    input_tokens = parts.admission.prompt_tokens
    if body.max_tokens == 0:
        return _prefill_only(parts), input_tokens
    return (parts if body.shows_thinking() else _without_reasoning(parts)), input_tokens


async def _prefill_only(parts: AsyncIterable[Part]) -> AsyncIterator[Part]:
    """`max_tokens: 0`: the prompt was prefilled (and so cached); the token generated to get
    there is not part of the answer."""
    async for part in parts:
        if isinstance(part, Finished):
            yield dataclasses.replace(part, reason="length", completion_tokens=0, stop_string=None)


async def _without_reasoning(parts: AsyncIterable[Part]) -> AsyncIterator[Part]:
    """`thinking` disabled or `display: omitted`: the model may still reason (whether it does
    is its own); its reasoning is not sent."""
    async for part in parts:
        if not isinstance(part, ReasoningPart):
            yield part


def _head(body: MessagesRequest) -> dict[str, Any]:
    return {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": body.model}


async def create_message(body: MessagesRequest, *, priority: int = 0) -> dict[str, Any]:
    """One non-streamed Message for `body` (also how message batches run their requests)."""
    parts, _ = await _begin(body, priority)
    *block_events, end = [event async for event in message_events(parts)]
    return {**_head(body), "content": fold(block_events), **end["delta"], "usage": end["usage"]}


@blueprint.post("/v1/messages")
async def messages() -> Any:
    body = await parse_body(MessagesRequest)
    if not body.stream:
        return await create_message(body)
    parts, input_tokens = await _begin(body)
    chunks = _stream(parts, _head(body), input_tokens)
    return await event_stream(_keep_alive(chunks, PING_INTERVAL_S))


@blueprint.post("/v1/messages/count_tokens")
async def count_tokens() -> Any:
    body = await parse_body(CountTokensRequest)
    entry, engine = await generation_engine(body.model)
    generation = GenerationRequest(
        request_id=new_id(""),
        model=entry.name,
        max_tokens=1,
        chat_template_kwargs=template_kwargs(entry),
        **prompt_fields(body),
    )
    return {"input_tokens": await engine.count_prompt_tokens(generation)}


@blueprint.post("/v1/messages/batch")
async def message_batch() -> Any:
    """The MLX Anthropic server's batch shape: a JSON list of Messages requests in,
    `{"results": [...]}` out in the same order, run concurrently through the batcher. A
    request that fails has an Anthropic error object in its place; the others still run."""
    items = await _json_list()
    ratelimit.admit_more(len(items) - 1)  # each item is a request (this one counted one)
    slots = asyncio.Semaphore(BATCH_CONCURRENCY)

    async def one(index: int, item: Any) -> dict[str, Any]:
        async with slots:
            try:
                return await create_message(_batch_item(index, item))
            except MlxdError as exc:
                return anthropic_error(exc)

    return {"results": await asyncio.gather(*(one(i, item) for i, item in enumerate(items)))}


async def _json_list() -> list[Any]:
    try:
        items = json.loads(await request.get_data())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(items, list) or not items:
        raise InvalidRequest("request body must be a non-empty JSON list of Messages requests")
    if len(items) > BATCH_MAX_REQUESTS:
        raise InvalidRequest(f"at most {BATCH_MAX_REQUESTS} requests per batch")
    return items


def _batch_item(index: int, item: Any) -> MessagesRequest:
    try:
        body = MessagesRequest.model_validate(item)
    except ValidationError as exc:
        raise InvalidRequest(f"{index}: {from_validation_error(exc).message}") from exc
    if body.stream:
        raise InvalidRequest(f"{index}: stream is not allowed in a batch", param="stream")
    return body


async def message_events(parts: AsyncIterable[Part]) -> AsyncIterator[dict[str, Any]]:
    """The content-block events of one answer, then its `message_delta` (stop reason, usage).
    Failures raise `MlxdError`."""
    blocks = ContentBlocks()
    async for part in parts:
        if isinstance(part, Finished):
            for event in blocks.close():
                yield event
            yield message_delta(part, blocks.called_tools)
        else:
            for event in blocks.feed(part):
                yield event


class ContentBlocks:
    """Parsed output parts as Anthropic content-block events. A block opens with its first
    part and closes when a part of another kind arrives; tool calls arrive one after another
    (model output is linear text), so only one block is ever open."""

    def __init__(self) -> None:
        self.count = 0
        self.open: tuple[str, int | None] | None = None  # (block type, tool call index)
        self.called_tools = False

    def feed(self, part: Part) -> list[dict[str, Any]]:
        if isinstance(part, TextPart) and part.text:
            return self._append(("text", None), {"type": "text_delta", "text": part.text})
        if isinstance(part, ReasoningPart) and part.text:
            delta = {"type": "thinking_delta", "thinking": part.text}
            return self._append(("thinking", None), delta)
        if isinstance(part, ToolCallStart):
            self.called_tools = True
            block = {"type": "tool_use", "id": part.id, "name": part.name, "input": {}}
            return [*self.close(), *self._begin(("tool_use", part.index), block)]
        if isinstance(part, ToolCallArgs):
            delta = {"type": "input_json_delta", "partial_json": part.fragment}
            return self._append(("tool_use", part.index), delta)
        if isinstance(part, ToolCallEnd):
            return self.close()
        return []  # empty text, logprobs: nothing to say in this dialect

    def close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.count - 1}]

    def _append(self, key: tuple[str, int | None], delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        if self.open != key:
            empty = {"text": {"text": ""}, "thinking": {"thinking": "", "signature": ""}}[key[0]]
            events = [*self.close(), *self._begin(key, {"type": key[0], **empty})]
        return [*events, {"type": "content_block_delta", "index": self.count - 1, "delta": delta}]

    def _begin(self, key: tuple[str, int | None], block: dict[str, Any]) -> list[dict[str, Any]]:
        self.open = key
        self.count += 1
        return [{"type": "content_block_start", "index": self.count - 1, "content_block": block}]


def message_delta(finished: Finished, called_tools: bool) -> dict[str, Any]:
    if finished.reason == "length":
        reason = "max_tokens"
    elif called_tools:
        reason = "tool_use"
    elif finished.stop_string is not None:
        reason = "stop_sequence"
    else:
        reason = "end_turn"
    return {
        "type": "message_delta",
        "delta": {
            "stop_reason": reason,
            "stop_sequence": finished.stop_string if reason == "stop_sequence" else None,
        },
        "usage": {
            "input_tokens": finished.prompt_tokens,
            "output_tokens": finished.completion_tokens,
        },
    }


def fold(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Content blocks from their stream events, accumulated as an SDK client does."""
    blocks: list[dict[str, Any]] = []
    arguments: dict[int, str] = {}
    for event in events:
        if event["type"] == "content_block_start":
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            index, delta = event["index"], event["delta"]
            if delta["type"] == "input_json_delta":
                arguments[index] = arguments.get(index, "") + delta["partial_json"]
            else:
                field = "text" if delta["type"] == "text_delta" else "thinking"
                blocks[index][field] += delta[field]
        elif event["type"] == "content_block_stop" and event["index"] in arguments:
            blocks[event["index"]]["input"] = json.loads(arguments[event["index"]])
    return blocks


async def _stream(
    parts: AsyncIterable[Part], head: dict[str, Any], input_tokens: int
) -> AsyncGenerator[bytes, None]:
    """Anthropic's SSE sequence; a failure after the headers went out becomes an error event."""
    message = {
        **head,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0},
    }
    yield _sse({"type": "message_start", "message": message})
    yield _sse(PING)  # as the real API does: the client knows it is live before prefill ends
    try:
        async for event in message_events(parts):
            yield _sse(event)
    except MlxdError as exc:
        yield _sse(anthropic_error(exc))
        return
    yield _sse({"type": "message_stop"})


async def _keep_alive(chunks: AsyncGenerator[bytes, None], interval: float) -> AsyncIterator[bytes]:
    """`chunks`, with a ping whenever none was sent for `interval` seconds. The next chunk is
    awaited in a task so that a ping never cancels (and so ends) the generation."""
    pending: asyncio.Future[bytes] | None = None
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(chunks))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield _sse(PING)
                continue
            try:
                chunk = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield chunk
    finally:
        if pending is not None and not pending.done():
            pending.cancel()  # the client went away: cancelling reaches the engine's sequence
            await asyncio.wait({pending})
        await chunks.aclose()


def _sse(payload: dict[str, Any]) -> bytes:
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"event: {payload['type']}\ndata: {data}\n\n".encode()
