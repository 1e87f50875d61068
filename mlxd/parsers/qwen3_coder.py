"""Qwen3-Coder tool calls, XML-ish with raw values:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values carry no type, so each becomes JSON by trying json.loads (numbers, booleans, objects)
and falling back to the string. The arguments stream one parameter at a time.
"""

from __future__ import annotations

import json
import re

from mlxd.parsers._stream import BufferedParser, Lead, find_first, held_back, match_lead
from mlxd.parsers.base import TextPart, ToolCallArgs, ToolCallEnd

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_NAME = re.compile(r"([^<>\n]*)(>?)")  # what follows `<function=` / `<parameter=`


def _tag_name(text: str, final: bool) -> Lead | None:
    """The name in `text` that a `>` closes: Lead(name, index past `>`), Lead(None, 0) while
    it is still open, None if it is not a name."""
    match = _NAME.match(text)
    assert match is not None  # the pattern matches the empty string
    name, closed = match.group(1).strip(), match.group(2)
    if closed and name:
        return Lead(name, match.end())
    if not closed and match.end() == len(text) and not final:
        return Lead(None, 0)
    return None


def _json_value(raw: str) -> object:
    value = raw.removeprefix("\n").removesuffix("\n")
    try:
        parsed = json.loads(value, parse_constant=_reject)
    except ValueError:
        return value
    return value if isinstance(parsed, str) else parsed


def _reject(constant: str) -> object:
    raise ValueError(constant)  # NaN / Infinity have no JSON text: keep such values strings


class Qwen3CoderParser(BufferedParser):
    def __init__(self) -> None:
        super().__init__()
        self._state = "text"  # text → function → body ⇄ value; body → after → text | function
        self._opened = ""  # `<tool_call>` while no function has started: text again if none does
        self._index = -1
        self._key = ""
        self._value: list[str] = []  # the current value's text so far
        self._params = 0

    def _step(self) -> bool:
        match self._state:
            case "text":
                if self._until([OPEN]) is None:
                    return False
                self._opened, self._state = OPEN, "function"
                return True
            case "function":
                return self._read_function()
            case "body":
                return self._read_body()
            case "value":
                return self._read_value()
            case _:
                return self._read_after()

    def _read_function(self) -> bool:
        lead = match_lead(self._buf, [FUNCTION], final=self._eof)
        if lead is not None and lead.marker is None:
            return False
        name = None if lead is None else _tag_name(self._buf[lead.end :], self._eof)
        if lead is None or name is None:
            self._emit(TextPart, self._opened)
            self._state = "text"
            return True
        if name.marker is None:
            return False
        start = self._start_call(name.marker)
        self._out.append(start)
        self._index, self._params, self._opened = start.index, 0, ""
        self._buf, self._state = self._buf[lead.end + name.end :], "body"
        return True

    def _read_body(self) -> bool:
        """Between parameters: the next one, or the end of the function."""
        markers = [PARAMETER, FUNCTION_END, CLOSE]
        hit = find_first(self._buf, markers)
        if hit is None:
            keep = 0 if self._eof else held_back(self._buf, markers)
            self._buf = self._buf[len(self._buf) - keep :]  # stray text between tags is dropped
            return False
        pos, marker = hit
        if marker != PARAMETER:
            self._end_call()
            self._buf = self._buf[pos + (len(FUNCTION_END) if marker == FUNCTION_END else 0) :]
            self._state = "after"
            return True
        key = _tag_name(self._buf[pos + len(PARAMETER) :], self._eof)
        if key is None:  # not a parameter tag: skip it
            self._buf = self._buf[pos + len(PARAMETER) :]
        elif key.marker is None:
            self._buf = self._buf[pos:]
            return False
        else:
            self._key, self._state = key.marker, "value"
            self._buf = self._buf[pos + len(PARAMETER) + key.end :]
        return True

    def _read_value(self) -> bool:
        # A missing </parameter> ends the value at the next tag.
        markers = [PARAMETER_END, PARAMETER, FUNCTION_END, CLOSE]
        hit = find_first(self._buf, markers)
        if hit is None:
            # Set the value's safe part aside, so long values are not searched again and again.
            cut = len(self._buf) - held_back(self._buf, markers)
            self._value.append(self._buf[:cut])
            self._buf = self._buf[cut:]
            return False
        pos, marker = hit
        value = json.dumps(_json_value("".join(self._value) + self._buf[:pos]), ensure_ascii=False)
        pair = f"{json.dumps(self._key, ensure_ascii=False)}: {value}"
        self._out.append(ToolCallArgs(self._index, ("{" if not self._params else ", ") + pair))
        self._params, self._value = self._params + 1, []
        self._buf = self._buf[pos + (len(PARAMETER_END) if marker == PARAMETER_END else 0) :]
        self._state = "body"
        return True

    def _read_after(self) -> bool:
        lead = match_lead(self._buf, [CLOSE, FUNCTION], final=self._eof)
        if lead is not None and lead.marker is None:
            return False
        if lead is None:
            self._state = "text"
        elif lead.marker == CLOSE:
            self._buf, self._state = self._buf[lead.end :], "text"
        else:
            self._state = "function"  # another call in the same block
        return True

    def _end_call(self) -> None:
        closing = "}" if self._params else "{}"
        self._out += [ToolCallArgs(self._index, closing), ToolCallEnd(self._index)]
        self._trim = True

    def _close(self) -> None:
        # Cut off inside a call: close it with the parameters that were complete.
        if self._state in ("body", "value"):
            self._end_call()
