"""The part of serving shared by every dialect: request → `GenerationRequest` → engine; what
comes back is read as parsed parts (`mlxd.api.common.parts`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from functools import partial
from typing import Any, TypeVar, cast

from pydantic import BaseModel, ValidationError
from quart import Response, request

from mlxd.api.common.cache_scope import cache_scope
from mlxd.api.common.context import current_app
from mlxd.api.common.error_shapes import from_validation_error
from mlxd.api.common.event_flow import in_runs, until
from mlxd.api.common.parts import Parts, parsed_events
from mlxd.api.middleware import auth, observe
from mlxd.config import SERVES, TEXT_KINDS, SamplingDefaults
from mlxd.control.routes import ModelEntry
from mlxd.errors import InvalidRequest
from mlxd.parsers.base import StreamParser
from mlxd.parsers.registry import compose, make_reasoning_parser, make_tool_parser
from mlxd.runtime.engine import Engine
from mlxd.types import Admission, Event, GenerationRequest, SamplingParams

Body = TypeVar("Body", bound=BaseModel)

log = logging.getLogger("mlxd.api")


async def parse_body(model: type[Body]) -> Body:
    """The JSON body validated against `model`; any problem is a 400 naming the field."""
    raw = await request.get_data()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    if isinstance(data.get("model"), str):
        observe.requested(data["model"], current_app.daemon.routes.ids.get(data["model"]))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


async def generation_engine(model_id: str) -> tuple[ModelEntry, Engine]:
    """The route entry and engine for a generation request (chat, completion, message),
    loading the model if needed. Other kinds cannot generate: 400 before any load."""
    entry = current_app.daemon.routes.entry(model_id, auth.caller())
    if entry.config.kind not in TEXT_KINDS:
        raise InvalidRequest(
            f"model '{model_id}' is of kind '{entry.config.kind}': it serves "
            f"{SERVES[entry.config.kind]}, not text generation",
            param="model",
        )
    return entry, await current_app.daemon.engine(entry.name, auth.caller())


def template_kwargs(
    entry: ModelEntry, requested: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """The chat template's extra variables: the model's YAML `chat_template_kwargs`, then the
    request's own (vLLM's field) key by key over them."""
    return {**entry.config.chat_template_kwargs, **(requested or {})} or None


# swift-mlx-server's per-request fields that mlxd cannot honour per request, and why. A
# request setting one gets a 400 naming it rather than an answer that silently ignored it.
UNHONOURED_FIELDS = {
    "kv_bits": "KV-cache quantization is set per model (cache.kv_bits in the YAML)",
    "kv_group_size": "KV-cache quantization is set per model (cache.kv_group_size in the YAML)",
    "kv_quantization_start": "KV-cache quantization is set per model and starts at once",
    "resize": "images are sized by the model's own processor; resize them before sending",
    "batch_size": "mlxd forms embedding batches itself across requests",
}


def refuse_unhonoured(body: BaseModel) -> None:
    """400 for the first field of UNHONOURED_FIELDS that `body` sets."""
    for name, why in UNHONOURED_FIELDS.items():
        if getattr(body, name, None) is not None:
            raise InvalidRequest(f"{name} is not supported: {why}", param=name)


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def sampling_params(
    defaults: SamplingDefaults,
    *,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    repetition_penalty: float | None = None,
    repetition_context_size: int | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    logit_bias: dict[int, float] | None = None,
    top_logprobs: int | None = None,
) -> SamplingParams:
    """The caller's sampling settings over the model's YAML `defaults`."""

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    return SamplingParams(
        temperature=pick(temperature, defaults.temperature),
        top_p=pick(top_p, defaults.top_p),
        top_k=pick(top_k, defaults.top_k),
        min_p=pick(min_p, defaults.min_p),
        seed=seed,
        repetition_penalty=pick(repetition_penalty, defaults.repetition_penalty),
        repetition_context_size=repetition_context_size,
        presence_penalty=pick(presence_penalty, defaults.presence_penalty),
        frequency_penalty=pick(frequency_penalty, defaults.frequency_penalty),
        logit_bias=logit_bias,
        top_logprobs=top_logprobs,
    )


def tool_choice(
    choice: str | None, named: str | None, names: set[str], *, required_word: str = "required"
) -> str | dict[str, Any] | None:
    """A dialect's tool_choice in the internal form: `choice` is the mode ("auto", "none",
    `required_word`) or `named` the one tool to call, which must be among `names`."""
    if named is not None:
        if named not in names:
            raise InvalidRequest(
                f"tool_choice names '{named}', which is not in tools", param="tool_choice"
            )
        return {"name": named}
    if choice == required_word:
        if not names:
            raise InvalidRequest(f"tool_choice '{choice}' needs tools", param="tool_choice")
        return "required"
    return choice


def constrained_output(
    kind: str | None, schema: Any, param: str, schema_field: str
) -> dict[str, Any] | None:
    """The internal `response_format` (what the constrained decoder enforces) for a dialect's
    structured-output setting: None for free text, json_object, or json_schema with `schema`."""
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{param} json_schema needs {schema_field}", param=param)
    return {"type": "json_schema", "schema": schema}


def refuse_tools_when_off(entry: ModelEntry, request: GenerationRequest) -> None:
    """Off means off: answering as if the tools were not there would silently drop them."""
    if request.tools and entry.config.parsers.tool_calls is None:
        raise InvalidRequest(
            f"model '{entry.name}' has tool calling turned off (parsers.tool_calls: null); "
            "send the request without tools",
            param="tools",
        )


def output_parser(
    entry: ModelEntry, engine: Engine, request: GenerationRequest, admission: Admission
) -> StreamParser:
    """How this response's text is read: tool calls (when the request offers tools) and
    reasoning, per the model's `parsers` settings (routing-level: they apply without reload)
    and what preparing the request found (`admission`)."""
    tool = None
    configured = entry.config.parsers.tool_calls
    if request.tools:
        name = "hermes" if admission.hermes_tools else configured or "auto"
        tool = make_tool_parser(
            name,
            getattr(engine, "chat_template", None),
            request.tools,
            getattr(engine, "tool_format", None),
        )
    reasoning = make_reasoning_parser(entry.config.parsers.reasoning, admission.reasoning_open)
    return compose(tool, reasoning)


async def start(
    entry: ModelEntry, engine: Engine, request: GenerationRequest, *, parse: bool = True
) -> Parts:
    """Submit to `engine`; its events come back read by the model's parsers (or as plain
    text when `parse` is False: raw completions). Interactive requests are bounded by
    `server.request_timeout`, queueing included; batch work (priority < 0) waits behind them
    by design and is not. Deltas come in runs of the model's (or server's) stream_interval
    tokens; a reader that falls server.stream_backlog events behind is cut off."""
    server = current_app.daemon.config.server
    timeout = server.request_timeout
    deadline = asyncio.get_running_loop().time() + timeout
    # What can refuse the request without the engine runs before it holds a slot there.
    refuse_tools_when_off(entry, request)
    if not request.stop and entry.config.defaults.stop:
        request = dataclasses.replace(request, stop=list(entry.config.defaults.stop))
    request.cache_scope = cache_scope()
    stream = await engine.submit(request)
    try:
        # This task reads the events and writes the response (streamed or not).
        reader = asyncio.current_task()
        if reader is not None:
            record = observe.current_record()
            stream.on_cut_off(partial(_disconnect, entry.name, request, record, reader))
        parser = (
            output_parser(entry, engine, request, stream.admission)
            if parse
            else compose(None, None)
        )
        events: AsyncGenerator[Event, None] = observe.observed(entry.name, stream)
        if request.priority >= 0:
            events = until(deadline, timeout, events)
        interval = entry.config.stream_interval or server.stream_interval
        if interval > 1:
            events = in_runs(interval, events)
        return Parts(stream.admission, parsed_events(parser, events))
    except BaseException:
        await stream.aclose()  # submitted: cancel it, or it would run to max_tokens
        raise


def _disconnect(
    model: str,
    request: GenerationRequest,
    record: observe.RequestRecord | None,
    reader: asyncio.Task[Any],
    backlog: int,
) -> None:
    """A client stopped reading its stream: its writer, stuck on the socket, is cancelled,
    which ends the response and closes the connection. Once: its other sequences (OpenAI's
    `n`) fall behind with it. The access log says 499, as for a client that left."""
    if reader.done() or reader.cancelling():
        return
    why = f"fell {backlog} events behind (server.stream_backlog): the client is not reading"
    log.warning(
        "model '%s': request %s %s; its sequence is cancelled and the response closed",
        model,
        record.request_id if record is not None else request.request_id,
        why,
    )
    if record is not None:
        record.status, record.error = 499, why
    reader.cancel()


async def event_stream(chunks: AsyncIterator[bytes]) -> Any:
    """A server-sent-events response. No timeout: a long generation is not a stuck one."""
    from quart import make_response

    # Quart's own Response (the stub's union also admits werkzeug's, which has no timeout).
    response = cast(
        Response,
        await make_response(
            chunks,
            200,
            {
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            },
        ),
    )
    response.timeout = None
    return response
