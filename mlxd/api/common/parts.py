"""A response's output as parsed parts: read from the engine's events by the model's
parsers, and drained into one result for the non-streaming answers."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from mlxd.errors import MlxdError, Unavailable
from mlxd.parsers.base import (
    OutputPart,
    ReasoningPart,
    StreamParser,
    TextPart,
    ToolCallArgs,
    ToolCallStart,
)
from mlxd.types import Admission, Delta, Event, Finished, TokenLogprob


class GenerationFailed(MlxdError):
    status = 500
    kind = "server_error"


@dataclass(frozen=True)
class Logprobs:
    """Token log-probabilities riding alongside the parsed parts."""

    items: list[TokenLogprob]


Part = OutputPart | Logprobs | Finished


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class Completion:
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: Finished | None = None


async def parsed_events(
    parser: StreamParser, events: AsyncGenerator[Event, None]
) -> AsyncGenerator[Part, None]:
    """The engine's text events read by `parser`; failures raise (see `raise_if_failed`).
    However this ends (a parser error, the caller going away), the engine's stream is
    closed here and then, not whenever the garbage collector gets to it: closing it is what
    cancels an unfinished sequence."""
    try:
        async for event in events:
            if isinstance(event, Delta):
                for part in parser.feed(event.text):
                    yield part
                if event.logprobs:
                    yield Logprobs(event.logprobs)
            else:
                for part in parser.finish():
                    yield part
                raise_if_failed(event)
                yield event
    finally:
        await events.aclose()


class Parts:
    """A response's parsed parts, and its `admission` (the prompt's size, known up front).
    Closing it early cancels the sequence."""

    def __init__(self, admission: Admission, parts: AsyncGenerator[Part, None]):
        self.admission = admission
        self._parts = parts

    def __aiter__(self) -> Parts:
        return self

    async def __anext__(self) -> Part:
        return await anext(self._parts)

    async def aclose(self) -> None:
        await self._parts.aclose()


def raise_if_failed(finished: Finished) -> None:
    if finished.reason == "error":
        failure = Unavailable if finished.error_status == 503 else GenerationFailed
        raise failure(finished.error or "generation failed")


async def collect(parts: AsyncIterator[Part]) -> Completion:
    """Drain parsed parts into one result (the non-streaming responses)."""
    result = Completion()
    text, reasoning = [], []
    async for part in parts:
        if isinstance(part, TextPart):
            text.append(part.text)
        elif isinstance(part, ReasoningPart):
            reasoning.append(part.text)
        elif isinstance(part, ToolCallStart):
            result.tool_calls.append(ToolCall(part.id, part.name))
        elif isinstance(part, ToolCallArgs):
            result.tool_calls[-1].arguments += part.fragment
        elif isinstance(part, Logprobs):
            result.logprobs.extend(part.items)
        elif isinstance(part, Finished):
            result.finished = part
    result.text, result.reasoning = "".join(text), "".join(reasoning)
    return result
