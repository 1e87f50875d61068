"""What a model's output text means: plain text, reasoning, or tool calls.

Engines stream decoded text; parsers turn it, incrementally, into these parts. Both API
dialects render the same parts (OpenAI `content` / `reasoning_content` / `tool_calls` deltas,
Anthropic `text` / `thinking` / `tool_use` blocks), so neither dialect parses model output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ReasoningPart:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call begins; `index` counts calls within one response from 0."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    """The next fragment of the call's arguments as JSON text; fragments concatenate to a
    complete JSON object by the matching ToolCallEnd."""

    index: int
    fragment: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


OutputPart = TextPart | ReasoningPart | ToolCallStart | ToolCallArgs | ToolCallEnd


class StreamParser(Protocol):
    """Incremental: `feed` any split of the text (one char at a time or all at once) and get
    the same parts, modulo how text/argument fragments are chunked. Never raises on model
    output: a malformed call comes out as TextPart."""

    def feed(self, text: str) -> list[OutputPart]: ...

    def finish(self) -> list[OutputPart]:
        """End of generation: flush held-back text; an unterminated call becomes text."""
        ...
