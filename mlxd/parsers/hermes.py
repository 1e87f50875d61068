"""Hermes / Qwen 2.5 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Several blocks in a row are parallel calls. `</tool_call>` ends a block even inside an
unbalanced object, so one missing brace does not swallow the rest of the output.
"""

from __future__ import annotations

from mlxd.parsers._json import CallReader
from mlxd.parsers._stream import BufferedParser, held_back, match_lead
from mlxd.parsers.base import TextPart

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(BufferedParser):
    def __init__(self) -> None:
        super().__init__()
        self._call: CallReader | None = None
        self._after = False  # a call's object closed: its </tool_call> may follow

    def _step(self) -> bool:
        if self._call is not None:
            return self._read_call(self._call)
        if self._after:
            lead = match_lead(self._buf, [CLOSE], final=self._eof)
            if lead is not None and lead.marker is None:
                return False
            self._after = False
            if lead is not None:
                self._buf = self._buf[lead.end :]
            return True
        if self._until([OPEN]) is None:
            return False
        self._call = CallReader(self._start_call)
        return True

    def _read_call(self, call: CallReader) -> bool:
        close = self._buf.find(CLOSE)
        if close >= 0:
            body = self._buf[:close]
        elif self._eof:
            body = self._buf
        else:
            body = self._buf[: len(self._buf) - held_back(self._buf, [CLOSE])]
        parts, used = call.feed(body)
        self._out += parts
        self._buf = self._buf[used:]
        if call.failed:
            self._emit(TextPart, OPEN + call.raw)
            self._call = None
        elif call.done:
            self._call, self._after, self._trim = None, True, True
        elif close >= 0:
            self._buf = self._buf[len(CLOSE) :]
            self._end_open_call(CLOSE)
        else:
            return False
        return True

    def _close(self) -> None:
        if self._call is not None:
            self._end_open_call("")

    def _end_open_call(self, tail: str) -> None:
        """The block ended before its object did: a committed call is cut, the rest is text."""
        assert self._call is not None
        if self._call.committed:
            self._out += self._call.cut()
            self._trim = True
        else:
            self._emit(TextPart, OPEN + self._call.raw + tail)
        self._call = None
