"""Mistral tool calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (older models)
and `[TOOL_CALLS]name[ARGS]{...}` (newer ones, one marker per call or one for several)."""

from __future__ import annotations

import re

from mlxd.parsers._json import ArgsStream, CallReader
from mlxd.parsers._stream import BufferedParser, match_lead
from mlxd.parsers.base import TextPart, ToolCallEnd

MARKER = "[TOOL_CALLS]"
_HEAD = re.compile(r"\s*([\w.\-]+)\s*\[ARGS\]\s*")
# Any prefix of a _HEAD match: what must wait for more text.
_HEAD_SO_FAR = re.compile(r"\s*[\w.\-]*\s*(?:\[(?:A(?:R(?:G(?:S(?:\]\s*)?)?)?)?)?)?")


class MistralParser(BufferedParser):
    def __init__(self) -> None:
        super().__init__()
        # text → tools → item → call → between → item … (a JSON list)
        #              → head → args → head …       (name[ARGS]{...} repeated)
        self._state = "text"
        self._opened = ""  # markup consumed since the last part: text again if no call follows
        self._call: CallReader | None = None
        self._args: ArgsStream | None = None

    def _step(self) -> bool:
        match self._state:
            case "text":
                if self._until([MARKER]) is None:
                    return False
                self._opened, self._state = MARKER, "tools"
                return True
            case "tools":
                return self._expect({"[": "item"}, otherwise="head")
            case "item":  # an empty list is no call: it stays text
                return self._expect({"{": "call"})
            case "between":
                return self._expect({",": "item", "]": "text"})
            case "call":
                return self._read_call()
            case "head":
                return self._read_head()
            case _:
                return self._read_args()

    def _expect(self, leads: dict[str, str], otherwise: str | None = None) -> bool:
        """Go to the state of whichever of `leads` comes next (a `{` is left for the call
        reader); with none of them, to `otherwise` or back to text."""
        lead = match_lead(self._buf, list(leads), final=self._eof)
        if lead is None:
            if otherwise is None:
                self._give_back()
            else:
                self._state = otherwise
        elif lead.marker is None:
            return False
        elif lead.marker == "{":
            self._call, self._state = CallReader(self._start_call), "call"
        else:
            self._opened += self._buf[: lead.end]
            self._buf, self._state = self._buf[lead.end :], leads[lead.marker]
            if self._state == "text":
                self._opened = ""
        return True

    def _read_call(self) -> bool:
        assert self._call is not None
        parts, used = self._call.feed(self._buf)
        self._out += parts
        self._buf = self._buf[used:]
        if self._call.failed:
            self._opened += self._call.raw
            self._give_back()
        elif self._call.done:
            self._call, self._opened, self._state, self._trim = None, "", "between", True
        else:
            return False
        return True

    def _read_head(self) -> bool:
        """`name[ARGS]`, then the arguments object: the call starts once that object opens."""
        head = _HEAD.match(self._buf)
        if head is not None and head.end() < len(self._buf):
            if self._buf[head.end()] != "{":
                self._give_back()
                return True
            start = self._start_call(head.group(1))
            self._out.append(start)
            self._args = ArgsStream(start.index)
            self._buf, self._state, self._opened = self._buf[head.end() :], "args", ""
            return True
        if not self._eof and _HEAD_SO_FAR.fullmatch(self._buf):
            return False
        self._give_back()
        return True

    def _read_args(self) -> bool:
        assert self._args is not None
        parts, used = self._args.feed(self._buf)
        self._out += parts
        self._buf = self._buf[used:]
        if not self._args.done:
            return False
        self._out.append(ToolCallEnd(self._args.index))
        # Newer models may write the next call as a bare name[ARGS] without a marker.
        self._args, self._state, self._trim = None, "head", True
        return True

    def _give_back(self) -> None:
        """No call here after all: the markup consumed since the last part is text."""
        self._emit(TextPart, self._opened)
        self._call, self._opened, self._state = None, "", "text"

    def _close(self) -> None:
        if self._args is not None:
            self._out.append(ToolCallEnd(self._args.index))
        elif self._call is not None and self._call.committed:
            self._out += self._call.cut()
        elif self._call is not None:
            self._opened += self._call.raw
            self._give_back()
