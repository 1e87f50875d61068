"""Reasoning in `<think>…</think>` comes out as ReasoningPart, the rest as TextPart."""

from __future__ import annotations

from mlxd.parsers._stream import BufferedParser, match_lead
from mlxd.parsers.base import ReasoningPart, TextPart

OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt leaves a think block open (DeepSeek-R1, Qwen3 thinking
    templates), so the output starts inside the reasoning and only closes it."""
    return prompt.rstrip().endswith(OPEN)


class ThinkParser(BufferedParser):
    def __init__(self, starts_inside: bool = False) -> None:
        super().__init__()
        self._inside = starts_inside
        self._reopened = starts_inside  # the model may still write the `<think>` itself
        self._trim = starts_inside

    def _step(self) -> bool:
        if self._reopened:
            lead = match_lead(self._buf, [OPEN], final=self._eof)
            if lead is not None and lead.marker is None:
                return False
            self._reopened = False
            if lead is not None:
                self._buf = self._buf[lead.end :]
            return True
        kind, marker = (ReasoningPart, CLOSE) if self._inside else (TextPart, OPEN)
        if self._until([marker], kind, strip=True) is None:
            return False
        self._inside, self._trim = not self._inside, True
        return True
