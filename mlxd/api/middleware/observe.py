"""Per-request observation: request ids, one log line per request, and the metrics.

Every HTTP request gets a `RequestRecord` (in `g`) when it arrives. The generation path shared
by both dialects (`generation.start`) feeds it the model, token counts and timings from the
engine's events; the record is closed when the response is out and its generation (if any)
has ended — for a stream that is after the last event, not when the headers are sent.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from quart import Quart, Response, current_app, g, has_app_context, request

from mlxd.types import Delta, Event, Finished


class Metrics(Protocol):
    """Where observed requests are counted (`api/ops/metrics.py` keeps the real one): this
    module knows only what it calls."""

    listeners: list[Callable[[dict[str, Any]], None]]  # each request's log fields

    def tokens(self, model: str, count: int) -> None: ...

    def observe(self, record: RequestRecord, duration_s: float) -> None: ...


log = logging.getLogger("mlxd.access")

# A client's own id is kept when it is short and printable: it lands in logs and headers.
_SANE_ID = re.compile(r"[A-Za-z0-9._:/@+=-]{1,128}")
# OpenAI clients read the first, Anthropic's the second.
ID_HEADERS = ("x-request-id", "request-id")
# Polled every few seconds by monitors: their lines would drown the requests that matter.
QUIET_ENDPOINTS = frozenset(
    {
        "/health",
        "/metrics",
        # The dashboard page (also a liveness probe: Ollama clients GET /) and its polling.
        "/",
        "/dashboard/static/<path:filename>",
        "/dashboard/api/state",
        "/dashboard/api/events",
    }
)


@dataclass
class RequestRecord:
    request_id: str
    endpoint: str
    started: float = field(default_factory=time.perf_counter)
    requested_model: str | None = None  # as the client wrote it (logged, never a metric label)
    model: str | None = None  # the routed model's name (a metric label: a bounded set)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    decode_s: float | None = None  # first token → last token
    status: int | None = None  # set when the response (or its stream) is known
    error: str | None = None
    generating: bool = False
    closed: bool = False
    # Held here, not looked up at close: a stream ends outside the app context.
    metrics: Metrics | None = None
    # Called once when the record closes, token counts known (rate limits charge tokens).
    on_close: list[Callable[[RequestRecord], None]] = field(default_factory=list)


def _current() -> RequestRecord | None:
    return g.get("record") if has_app_context() else None


def request_id() -> str:
    """The current request's id ("" outside a request)."""
    record = _current()
    return record.request_id if record else ""


def current_record() -> RequestRecord | None:
    """The current request's record, for an outcome decided later outside its context."""
    return _current()


def requested(model: str, name: str | None) -> None:
    """Note the model id the client asked for and the model it routes to (None: unknown)."""
    record = _current()
    if record is not None:
        record.requested_model, record.model = model[:200], name


_PLAIN = re.compile(r"[\w.:/@+-]+")


def _token(value: Any) -> str:
    """A log field as is when it is one plain word, else quoted: a client-chosen model id
    must not forge a log line or a field."""
    text = str(value)
    return text if _PLAIN.fullmatch(text) else json.dumps(text)


def failed(message: str) -> None:
    """Note why the current request failed; its log line says so."""
    record = _current()
    if record is not None:
        record.error = message[:300]


def _incoming_id() -> str:
    for header in ID_HEADERS:
        value = request.headers.get(header, "")
        if _SANE_ID.fullmatch(value):
            return value
    return f"req_{uuid.uuid4().hex[:24]}"


def install(app: Quart, metrics: Metrics) -> None:
    """Open a record per request; add the id headers; close records that have no stream."""

    @app.before_request
    async def open_record() -> None:
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        g.record = RequestRecord(_incoming_id(), rule, metrics=metrics)

    @app.after_request
    async def tag_response(response: Response) -> Response:
        record: RequestRecord | None = g.get("record")
        if record is None:  # a failure before before_request ran
            return response
        for header in ID_HEADERS:
            response.headers[header] = record.request_id
        if record.status is None:
            record.status = response.status_code
        if not record.generating:
            close(record)
        return response


def count_prompt_tokens(prompt_tokens: int) -> None:
    """Tokens of a request that generates nothing (embeddings, rerank), for its log line,
    and for rate limits."""
    record = _current()
    if record is not None:
        record.prompt_tokens = prompt_tokens


def observed(model: str, events: AsyncIterator[Event]) -> AsyncGenerator[Event, None]:
    """`events` of a generation by `model`, recording TTFT, token counts and the outcome into
    the request's record. Outside an HTTP request (message batches run in the background) a
    record of their own is kept."""
    record = _current()
    if record is None:
        metrics = current_app.extensions.get("mlxd_metrics")
        record = RequestRecord(f"req_{uuid.uuid4().hex[:24]}", "batch", status=200, metrics=metrics)
    record.model = model
    record.generating = True  # now, not at the first event: the response may go out before
    return _observe(record, events)


async def _observe(
    record: RequestRecord, events: AsyncIterator[Event]
) -> AsyncGenerator[Event, None]:
    first_token: float | None = None
    try:
        async for event in events:
            if isinstance(event, Delta) and event.token_ids:
                if first_token is None:
                    first_token = time.perf_counter()
                    record.ttft_s = first_token - record.started
                if record.metrics is not None and record.model:
                    record.metrics.tokens(record.model, len(event.token_ids))
            elif isinstance(event, Finished):
                # Summed: one request may run several sequences (n, prompt lists, batches).
                record.prompt_tokens += event.prompt_tokens
                record.completion_tokens += event.completion_tokens
                if first_token is not None:
                    record.decode_s = time.perf_counter() - first_token
                if event.reason == "error":
                    record.status, record.error = 500, event.error
                elif event.reason == "cancelled" and record.status in (None, 200):
                    record.status = 499  # the client went away (nginx's name for it)
            yield event
    finally:
        record.generating = False
        if record.status is not None:  # else the response is not out yet: after_request closes
            close(record)


def close(record: RequestRecord) -> None:
    """Log the request and count it, once."""
    if record.closed:
        return
    record.closed = True
    for hook in record.on_close:
        hook(record)
    duration = time.perf_counter() - record.started
    if record.metrics is not None:
        record.metrics.observe(record, duration)
    fields: dict[str, Any] = {
        "request_id": record.request_id,
        "model": record.model or record.requested_model,
        "endpoint": record.endpoint,
        "status": record.status,
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "ttft_ms": None if record.ttft_s is None else round(record.ttft_s * 1000, 1),
        "duration_ms": round(duration * 1000, 1),
        "error": record.error,
    }
    text = " ".join(f"{k}={_token(v)}" for k, v in fields.items() if v is not None and k != "error")
    if record.error:
        text += f" error={json.dumps(record.error)}"  # quoted: messages have spaces
    level = logging.DEBUG if record.endpoint in QUIET_ENDPOINTS else logging.INFO
    log.log(level, "request %s", text, extra={"fields": fields})
    for listener in record.metrics.listeners if record.metrics is not None else ():
        listener(fields)
