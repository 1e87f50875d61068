"""Parsed output parts → Responses API output items and their stream events.

One builder serves both answers: the stream sends its events as they come, and the
non-streamed answer is the `output` the same events built, so the two agree by construction.
Events follow the documented order, which the `openai` SDK's `responses.stream()` helper
checks: `output_item.added`, then the item's part/delta/done events, then `output_item.done`.
Reasoning is a `reasoning` item with one summary part, text a `message` item with one
`output_text` part, each tool call a `function_call` item. Sequence numbers are added by
the caller, who alone knows the whole stream.
"""

from __future__ import annotations

import copy
from typing import Any

from mlxd.api.common.generation import new_id
from mlxd.api.common.parts import Part
from mlxd.parsers.base import ReasoningPart, TextPart, ToolCallArgs, ToolCallEnd, ToolCallStart
from mlxd.types import Finished

Event = dict[str, Any]


class OutputItems:
    """Feeds parts, returns events; `output` holds the items built so far. Model output is
    linear, so at most one item is open at a time: a part of another kind closes it."""

    def __init__(self) -> None:
        self.output: list[dict[str, Any]] = []
        self.open: tuple[str, int | None] | None = None  # (item type, tool call index)

    def feed(self, part: Part) -> list[Event]:
        if isinstance(part, TextPart) and part.text:
            return self._text("message", part.text)
        if isinstance(part, ReasoningPart) and part.text:
            return self._text("reasoning", part.text)
        if isinstance(part, ToolCallStart):
            item = {
                "id": new_id("fc_"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": part.id,
                "name": part.name,
                "arguments": "",
            }
            return [*self.close(), *self._begin(("function_call", part.index), item)]
        if isinstance(part, ToolCallArgs) and self.open == ("function_call", part.index):
            self.output[-1]["arguments"] += part.fragment
            return [self._event("response.function_call_arguments.delta", delta=part.fragment)]
        if isinstance(part, ToolCallEnd):
            return self.close()
        return []  # empty text, logprobs, Finished: no item event

    def close(self, status: str = "completed") -> list[Event]:
        """Close the open item (`status` "incomplete" when generation was cut short)."""
        if self.open is None:
            return []
        kind, item = self.open[0], self.output[-1]
        if kind == "message":
            part = item["content"][0]
            events = [
                self._event(
                    "response.output_text.done", content_index=0, text=part["text"], logprobs=[]
                ),
                self._event("response.content_part.done", content_index=0, part=part),
            ]
        elif kind == "reasoning":
            summary = item["summary"][0]
            events = [
                self._event(
                    "response.reasoning_summary_text.done", summary_index=0, text=summary["text"]
                ),
                self._event("response.reasoning_summary_part.done", summary_index=0, part=summary),
            ]
        else:
            events = [
                self._event(
                    "response.function_call_arguments.done",
                    name=item["name"],
                    arguments=item["arguments"],
                )
            ]
        item["status"] = status
        events.append(self._item_event("response.output_item.done"))
        self.open = None
        return events

    def _text(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self.open != (kind, None):
            events = [*self.close(), *self._open_text(kind)]
        item = self.output[-1]
        if kind == "message":
            item["content"][0]["text"] += text
            delta = self._event(
                "response.output_text.delta", content_index=0, delta=text, logprobs=[]
            )
        else:
            item["summary"][0]["text"] += text
            delta = self._event(
                "response.reasoning_summary_text.delta", summary_index=0, delta=text
            )
        return [*events, delta]

    def _open_text(self, kind: str) -> list[Event]:
        if kind == "message":
            item: dict[str, Any] = {
                "id": new_id("msg_"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events = self._begin((kind, None), item)
            item["content"].append(part)
            added = "response.content_part.added"
            return [*events, self._event(added, content_index=0, part=copy.deepcopy(part))]
        item = {"id": new_id("rs_"), "type": "reasoning", "status": "in_progress", "summary": []}
        summary = {"type": "summary_text", "text": ""}
        events = self._begin((kind, None), item)
        item["summary"].append(summary)
        added = "response.reasoning_summary_part.added"
        return [*events, self._event(added, summary_index=0, part=copy.deepcopy(summary))]

    def _begin(self, key: tuple[str, int | None], item: dict[str, Any]) -> list[Event]:
        self.output.append(item)
        self.open = key
        return [self._item_event("response.output_item.added")]

    def _item_event(self, kind: str) -> Event:
        item = copy.deepcopy(self.output[-1])
        return {"type": kind, "output_index": len(self.output) - 1, "item": item}

    def _event(self, kind: str, **fields: Any) -> Event:
        index = len(self.output) - 1
        return {"type": kind, "item_id": self.output[index]["id"], "output_index": index, **fields}


def usage(finished: Finished) -> dict[str, Any]:
    """The Responses usage object: every prompt token counts as input, cached or not."""
    return {
        "input_tokens": finished.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": finished.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
    }


def outcome(finished: Finished) -> tuple[str, dict[str, str] | None]:
    """(status, incomplete_details) for how generation ended."""
    if finished.reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None
