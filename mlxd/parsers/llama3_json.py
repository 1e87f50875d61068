"""Llama 3.x JSON tool calls: the response is `{"name": ..., "parameters": {...}}`, maybe after
`<|python_tag|>`, several separated by `;`.

Only output that starts (after whitespace) with `{` or the tag is read as calls: these
templates put no marker around a call, so any other output is plain text.
"""

from __future__ import annotations

from mlxd.parsers._json import CallReader
from mlxd.parsers._stream import BufferedParser, match_lead
from mlxd.parsers.base import TextPart

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(BufferedParser):
    def __init__(self) -> None:
        super().__init__()
        self._text = False  # decided: the rest of the output is plain text
        self._call: CallReader | None = None
        self._opened = ""  # the tag before the current call, text again if the call fails

    def _step(self) -> bool:
        if self._text:
            self._emit(TextPart, self._buf)
            self._buf = ""
            return False
        if self._call is not None:
            return self._read_call(self._call)
        options = ["{", PYTHON_TAG] if self._calls == 0 else ["{", PYTHON_TAG, ";"]
        lead = match_lead(self._buf, options, final=self._eof)
        if lead is None:
            self._text = True
        elif lead.marker is None:
            return False
        elif lead.marker == ";":
            self._buf = self._buf[lead.end :]
        else:
            if lead.marker == PYTHON_TAG:
                self._opened, self._buf = self._buf[: lead.end], self._buf[lead.end :]
            self._call = CallReader(self._start_call)
        return True

    def _read_call(self, call: CallReader) -> bool:
        parts, used = call.feed(self._buf)
        self._out += parts
        self._buf = self._buf[used:]
        if call.failed:
            self._give_back(call)
            self._text = True
        elif call.done:
            self._call, self._opened, self._trim = None, "", True
        else:
            return False
        return True

    def _close(self) -> None:
        if self._call is None:
            return
        if self._call.committed:
            self._out += self._call.cut()
        else:
            self._give_back(self._call)

    def _give_back(self, call: CallReader) -> None:
        """Not a call after all: what it consumed is text."""
        self._emit(TextPart, self._opened + call.raw)
        self._call = None
