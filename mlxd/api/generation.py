"""The part of serving shared by every dialect: request → `GenerationRequest`, events → result."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from quart import request

from mlxd.api.errors import from_validation_error
from mlxd.config import SamplingDefaults
from mlxd.engines.base import Delta, Event, Finished, SamplingParams, TokenLogprob
from mlxd.errors import InvalidRequest, MlxdError

Body = TypeVar("Body", bound=BaseModel)


class GenerationFailed(MlxdError):
    status = 500
    kind = "server_error"


async def parse_body(model: type[Body]) -> Body:
    """The JSON body validated against `model`; any problem is a 400 naming the field."""
    raw = await request.get_data()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


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
        presence_penalty=pick(presence_penalty, defaults.presence_penalty),
        frequency_penalty=pick(frequency_penalty, defaults.frequency_penalty),
        logit_bias=logit_bias,
        top_logprobs=top_logprobs,
    )


@dataclass
class Completion:
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: Finished | None = None


def raise_if_failed(finished: Finished) -> None:
    if finished.reason == "error":
        raise GenerationFailed(finished.error or "generation failed")


async def collect(events: AsyncIterator[Event]) -> Completion:
    """Drain an event stream into one result (the non-streaming responses)."""
    result = Completion()
    parts = []
    async for event in events:
        if isinstance(event, Delta):
            parts.append(event.text)
            result.logprobs.extend(event.logprobs or [])
        else:
            raise_if_failed(event)
            result.finished = event
    result.text = "".join(parts)
    return result


def usage(finished: Finished) -> dict[str, int]:
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": finished.completion_tokens,
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
    }


async def event_stream(chunks: AsyncIterator[bytes]) -> Any:
    """A server-sent-events response. No timeout: a long generation is not a stuck one."""
    from quart import make_response

    response = await make_response(
        chunks,
        200,
        {
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        },
    )
    response.timeout = None
    return response
