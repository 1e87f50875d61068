"""OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request becomes the same `GenerationRequest` as a chat completion (input items →
messages in `responses_input`) and goes through `mlxd.api.common.generation`; the answer is
rendered from the parsed parts by `responses_output`. One event sequence builds both the
stream and the non-streamed answer. Stored answers (`store`, default true) live on disk
(`response_store`), owned by the API key that made them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from quart import Blueprint, request

from mlxd.api.common import housekeeping
from mlxd.api.common.context import current_app
from mlxd.api.common.error_shapes import openai_error
from mlxd.api.common.generation import (
    constrained_output,
    event_stream,
    generation_engine,
    new_id,
    parse_body,
    sampling_params,
    start,
    tool_choice,
)
from mlxd.api.common.parts import Part
from mlxd.api.middleware.auth import keys_required, owner_of, presented_key
from mlxd.api.openai.responses.input import input_items, messages
from mlxd.api.openai.responses.output import OutputItems, outcome, usage
from mlxd.api.openai.responses.protocol import ResponseCreateRequest
from mlxd.api.openai.responses.store import ResponseStore
from mlxd.control.routes import ModelEntry
from mlxd.errors import InvalidRequest, MlxdError, NotFound
from mlxd.types import Finished, GenerationRequest

blueprint = Blueprint("responses", __name__)

Event = dict[str, Any]
PRUNE_INTERVAL_S = 600.0


def _store() -> ResponseStore:
    """The store under the live config's cache_dir (a reload may move it or change the TTL)."""
    server = current_app.daemon.config.server
    folder = server.cache_dir / "responses"
    store = current_app.extensions.get("response_store")
    if store is None or store.folder != folder:
        store = current_app.extensions["response_store"] = ResponseStore(folder, 0)
    store.ttl_s = server.responses_ttl
    return store


@blueprint.before_app_serving
async def start_pruning() -> None:
    """Expired responses are deleted at start and every PRUNE_INTERVAL_S."""
    app: Any = current_app._get_current_object()  # type: ignore[attr-defined]

    async def prune() -> None:
        await asyncio.to_thread(_store().prune)

    app.extensions["response_pruning"] = housekeeping.every(app, PRUNE_INTERVAL_S, prune)


@blueprint.after_app_serving
async def stop_pruning() -> None:
    await housekeeping.stop(current_app.extensions.pop("response_pruning", None))


def _owner() -> str:
    return owner_of(presented_key(request.headers))


def _generation(
    body: ResponseCreateRequest, entry: ModelEntry, items: list[dict[str, Any]]
) -> GenerationRequest:
    tools = [
        {
            "type": "function",
            "function": t.model_dump(exclude={"type", "strict"}, exclude_none=True),
        }
        for t in body.function_tools()
    ]
    names = {t.name for t in body.function_tools()}
    choice = body.tool_choice
    internal_choice = (
        tool_choice(None, choice.name, names)
        if choice is not None and not isinstance(choice, str)
        else tool_choice(choice, None, names)
    )
    text_format = body.text.format if body.text else None
    response_format = (
        constrained_output(
            text_format.type, text_format.schema_, "text.format", "text.format.schema"
        )
        if text_format
        else None
    )
    defaults = entry.config.defaults
    return GenerationRequest(
        request_id=new_id(""),
        model=entry.name,
        max_tokens=body.max_output_tokens or defaults.max_tokens,
        sampling=sampling_params(defaults, temperature=body.temperature, top_p=body.top_p),
        messages=messages(items, body.instructions),
        # "none" keeps tools out of the prompt altogether, so none can be called.
        tools=None if internal_choice == "none" or not tools else tools,
        tool_choice=internal_choice,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        response_format=response_format,
    )


def initial_response(
    body: ResponseCreateRequest, generation: GenerationRequest, response_id: str
) -> dict[str, Any]:
    """The Response object as it stands before any output: status in_progress."""
    text_format = body.text.format if body.text and body.text.format else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": body.model,
        "output": [],
        "parallel_tool_calls": generation.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": {
            "effort": body.reasoning.effort if body.reasoning else None,
            "summary": body.reasoning.summary if body.reasoning else None,
        },
        "store": body.store,
        "temperature": generation.sampling.temperature,
        "top_p": generation.sampling.top_p,
        "text": {
            "format": text_format.model_dump(by_alias=True, exclude_none=True)
            if text_format
            else {"type": "text"}
        },
        "tool_choice": (
            body.tool_choice.model_dump()
            if body.tool_choice is not None and not isinstance(body.tool_choice, str)
            else body.tool_choice or "auto"
        ),
        "tools": [t.model_dump() for t in body.tools or []],
        "truncation": "disabled",
        "usage": None,
        "metadata": body.metadata or {},
    }


async def response_events(
    parts: AsyncIterator[Part],
    response: dict[str, Any],
    save: Callable[[dict[str, Any]], Awaitable[None]],
) -> AsyncGenerator[Event, None]:
    """Every event of one response, lifecycle included, without sequence numbers. The last
    is `response.completed` (or `.incomplete`) carrying the whole Response, stored first by
    `save` (so a client that reads it can retrieve it at once). Failures raise MlxdError."""
    yield {"type": "response.created", "response": dict(response)}
    yield {"type": "response.in_progress", "response": dict(response)}
    items = OutputItems()
    async for part in parts:
        if not isinstance(part, Finished):
            for event in items.feed(part):
                yield event
            continue
        status, incomplete = outcome(part)
        for event in items.close("completed" if status == "completed" else "incomplete"):
            yield event
        final = {
            **response,
            "status": status,
            "incomplete_details": incomplete,
            "output": items.output,
            "usage": usage(part),
        }
        await save(final)
        yield {"type": f"response.{status}", "response": final}


@blueprint.post("/v1/responses")
async def create_response() -> Any:
    body = await parse_body(ResponseCreateRequest)
    store, owner = _store(), _owner()
    own_items = input_items(body.input)
    items = own_items
    if body.previous_response_id:
        try:
            earlier = await asyncio.to_thread(store.conversation, owner, body.previous_response_id)
        except NotFound as exc:
            exc.param = "previous_response_id"
            raise
        items = [*earlier, *own_items]
    if body.store:
        config = current_app.daemon.config
        keyed = keys_required(config)
        await asyncio.to_thread(
            store.admit, owner if keyed else None, config.server.stored_responses
        )
    entry, engine = await generation_engine(body.model)
    generation = _generation(body, entry, items)  # every check before the sequence starts
    response = initial_response(body, generation, new_id("resp_"))

    async def save(final: dict[str, Any]) -> None:
        if body.store:
            previous = body.previous_response_id
            await asyncio.to_thread(store.save, owner, final, own_items, previous)

    parts = await start(entry, engine, generation)
    events = response_events(parts, response, save)
    if body.stream:
        return await event_stream(_stream(events, response))
    try:
        async for event in events:
            last = event
    finally:
        await events.aclose()
    return last["response"]


async def _stream(
    events: AsyncGenerator[Event, None], response: dict[str, Any]
) -> AsyncIterator[bytes]:
    """The SSE stream, numbered in order. A failure after the headers went out is an `error`
    event and then `response.failed`, as the API does."""
    numbers = itertools.count()
    try:
        async for event in events:
            yield _sse(event, next(numbers))
    except MlxdError as exc:
        error = openai_error(exc)["error"]
        yield _sse({"type": "error", **error, "code": error["type"]}, next(numbers))
        failed = {
            **response,
            "status": "failed",
            "error": {"code": "server_error", "message": exc.message},
        }
        yield _sse({"type": "response.failed", "response": failed}, next(numbers))
    finally:
        await events.aclose()


def _sse(event: Event, number: int) -> bytes:
    data = json.dumps({**event, "sequence_number": number}, ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


@blueprint.get("/v1/responses/<response_id>")
async def retrieve_response(response_id: str) -> Any:
    record = await asyncio.to_thread(_store().load, _owner(), response_id)
    return record["response"]


@blueprint.get("/v1/responses/<response_id>/input_items")
async def list_input_items(response_id: str) -> Any:
    """The whole input a stored response answered (earlier turns of a `previous_response_id`
    chain included), newest first unless `order=asc`, `limit` per page, `after` an item id."""
    stored = await asyncio.to_thread(_store().input_of, _owner(), response_id)
    items = [_listed(item, response_id, index) for index, item in enumerate(stored)]
    order, after = request.args.get("order", "desc"), request.args.get("after")
    limit = request.args.get("limit", "20")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be 'asc' or 'desc'", param="order")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise InvalidRequest("limit must be an integer from 1 to 100", param="limit")
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise InvalidRequest(f"no input item '{after}' in this response", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[: int(limit)]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > len(page),
    }


def _listed(item: dict[str, Any], response_id: str, index: int) -> dict[str, Any]:
    """A stored input item as the API lists it: with an id (its own, or one derived from its
    place, so it is the same on every call) and a status; string content as one text part."""
    kind = item.get("type", "message")
    listed = {"id": f"{kind[:2]}_{response_id[5:]}_{index}", "status": "completed", **item}
    listed["type"] = kind
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        listed["content"] = [{"type": part, "text": item["content"]}]
    return listed


@blueprint.delete("/v1/responses/<response_id>")
async def delete_response(response_id: str) -> Any:
    await asyncio.to_thread(_store().delete, _owner(), response_id)
    return {"id": response_id, "object": "response", "deleted": True}
