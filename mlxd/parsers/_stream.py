"""Machinery every streaming parser shares: the input buffer, marker look-ahead, call ids.

Whitespace after a tool call and at the edges of a think block is dropped, so clients do not
get a text block holding only the newlines a template puts between calls.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import NamedTuple

from mlxd.parsers.base import OutputPart, ReasoningPart, TextPart, ToolCallStart


def held_back(text: str, markers: Sequence[str], space: bool = False) -> int:
    """How many chars at the end of `text` must wait for more input: a tail that could still
    grow into one of `markers`, with `space` also the whitespace before it."""
    keep = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), keep, -1):
            if text.endswith(marker[:size]):
                keep = size
                break
    while space and keep < len(text) and text[-keep - 1].isspace():
        keep += 1
    return keep


def find_first(text: str, markers: Sequence[str]) -> tuple[int, str] | None:
    """The earliest occurrence of any marker as (position, marker)."""
    hits = [(pos, marker) for marker in markers if (pos := text.find(marker)) >= 0]
    return min(hits, key=lambda hit: (hit[0], -len(hit[1])), default=None)


class Lead(NamedTuple):
    """What `match_lead` found: `marker` None means the text is still too short to tell."""

    marker: str | None
    end: int


def match_lead(text: str, options: Sequence[str], final: bool = False) -> Lead | None:
    """Whether `text` starts, after whitespace, with one of `options`: Lead(option, index past
    it), Lead(None, 0) while it still could, None when it cannot (or `final` and it did not)."""
    start = len(text) - len(text.lstrip())
    rest = text[start:]
    for option in options:
        if rest.startswith(option):
            return Lead(option, start + len(option))
    if not final and any(option.startswith(rest) for option in options):
        return Lead(None, 0)
    return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class BufferedParser:
    """Base of the parsers: `feed` appends to a buffer and runs `_step` until it waits.

    Subclasses implement `_step` (consume from `self._buf`, emit parts; return False when
    more input is needed) and `_close` (input ended in the middle of something). While
    `self._eof` is set, `_step` must not wait on the buffer: whatever it holds is decided.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._eof = False
        self._out: list[OutputPart] = []
        self._calls = 0
        self._trim = False  # drop the leading whitespace of the next text or reasoning

    def feed(self, text: str) -> list[OutputPart]:
        self._buf += text
        while self._step():
            pass
        return self._take()

    def finish(self) -> list[OutputPart]:
        self._eof = True
        while self._step():
            pass
        self._close()
        return self._take()

    def _step(self) -> bool:
        raise NotImplementedError

    def _close(self) -> None:
        pass

    def _take(self) -> list[OutputPart]:
        out, self._out = self._out, []
        return out

    def _emit(self, kind: type[TextPart] | type[ReasoningPart], text: str) -> None:
        """Text or reasoning, merged into the previous part when it has the same kind."""
        if self._trim:
            text = text.lstrip()
        if not text:
            return
        self._trim = False
        last = self._out[-1] if self._out else None
        if isinstance(last, kind):
            self._out[-1] = kind(last.text + text)
        else:
            self._out.append(kind(text))

    def _until(
        self,
        markers: Sequence[str],
        kind: type[TextPart] | type[ReasoningPart] = TextPart,
        strip: bool = False,
    ) -> str | None:
        """Emit the buffer as `kind` up to the first marker, which is consumed and returned;
        None when no marker is in sight (a possible marker prefix stays buffered). `strip`
        drops the whitespace before the marker: only where the marker is surely a boundary."""
        hit = find_first(self._buf, markers)
        if hit is not None:
            pos, marker = hit
            text = self._buf[:pos]
            self._emit(kind, text.rstrip() if strip else text)
            self._buf = self._buf[pos + len(marker) :]
            return marker
        cut = len(self._buf) - (0 if self._eof else held_back(self._buf, markers, strip))
        self._emit(kind, self._buf[:cut])
        self._buf = self._buf[cut:]
        return None

    def _start_call(self, name: str) -> ToolCallStart:
        start = ToolCallStart(index=self._calls, id=new_call_id(), name=name)
        self._calls += 1
        return start
