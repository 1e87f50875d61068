"""The Ollama dialect's translation, both ways: an Ollama request as the internal
`GenerationRequest` (sampling options, messages with images and tool calls, `format`), and the
one parsed part stream as Ollama's message deltas and durations."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from mlxd.api.common.generation import new_id, sampling_params
from mlxd.api.common.parts import Logprobs, Parts
from mlxd.api.ollama.protocol import ChatRequest, GenerateRequest, Message
from mlxd.api.ollama.render import parse_arguments
from mlxd.control.routes import ModelEntry
from mlxd.parsers.base import ReasoningPart, TextPart, ToolCallArgs, ToolCallEnd, ToolCallStart
from mlxd.types import Finished, GenerationRequest


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


def sampling_request(
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
    parts: Parts, timing: Timing, *, think: bool
) -> AsyncGenerator[dict[str, Any], None]:
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
