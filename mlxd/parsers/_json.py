"""JSON tool calls read as they arrive: `{"name": ..., "arguments": {...}}` objects.

Hermes, Llama 3 and Mistral all write calls as such objects; they differ only in what
surrounds them, so the object itself is read here once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator

from mlxd.parsers.base import OutputPart, ToolCallArgs, ToolCallEnd, ToolCallStart

ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3 templates ask for "parameters"

_STRUCTURE = re.compile(r'[][{}"]')
_IN_STRING = re.compile(r'["\\]')
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


class JsonScanner:
    """Finds where a JSON object or array that arrives in pieces closes: bracket depth,
    skipping brackets inside strings. It does not validate; json.loads does that later."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def scan(self, text: str) -> int:
        """Index just past the bracket that closes the value, or -1 if `text` ends first."""
        i = 0
        while i < len(text):
            if self._escaped:
                self._escaped, i = False, i + 1
            elif self._in_string:
                match = _IN_STRING.search(text, i)
                if match is None:
                    return -1
                i = match.end()
                if match.group() == "\\":
                    self._escaped = True
                else:
                    self._in_string = False
            else:
                match = _STRUCTURE.search(text, i)
                if match is None:
                    return -1
                i, char = match.end(), match.group()
                if char == '"':
                    self._in_string = True
                elif char in "[{":
                    self._depth += 1
                else:
                    self._depth -= 1
                    if self._depth == 0:
                        return i
        return -1


class ArgsStream:
    """Passes an arguments object's text on as ToolCallArgs fragments until it closes."""

    def __init__(self, index: int) -> None:
        self.index = index
        self._scanner = JsonScanner()
        self.done = False

    def feed(self, text: str) -> tuple[list[OutputPart], int]:
        """Parts for `text` (which starts at or inside the object) and how much of it was used."""
        end = self._scanner.scan(text)
        used = len(text) if end < 0 else end
        self.done = end >= 0
        return ([ToolCallArgs(self.index, text[:used])] if used else []), used


def arguments_json(arguments: object) -> str | None:
    """Arguments as a JSON object text, also when a model wrote them as a JSON string."""
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except ValueError:
            return None
        return arguments if isinstance(decoded, dict) else None
    return json.dumps(arguments, ensure_ascii=False) if isinstance(arguments, dict) else None


def parse_call(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a complete call object, or None if it is not one."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict):
        return None
    name = call.get("name")
    key = next((key for key in ARGUMENT_KEYS if key in call), None)
    arguments = None if key is None else arguments_json(call[key])
    if not isinstance(name, str) or not name or arguments is None:
        return None
    return name, arguments


def _tokens(text: str) -> Iterator[tuple[str, int]]:
    """Complete JSON tokens of `text` as (token, end): strings whole, anything else one char
    at a time; stops before a string that is still open."""
    i = 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return
        if text[i] == '"':
            match = _STRING.match(text, i)
            if match is None:
                return
            i = match.end()
            yield match.group(), i
        else:
            i += 1
            yield text[i - 1], i


def _string(token: str) -> str | None:
    if not token.startswith('"'):
        return None
    try:
        return json.loads(token)
    except ValueError:
        return None


_HEADER: list[Callable[[str], bool]] = [
    lambda t: t == "{",
    lambda t: _string(t) == "name",
    lambda t: t == ":",
    lambda t: bool(_string(t)),  # the name
    lambda t: t == ",",
    lambda t: _string(t) in ARGUMENT_KEYS,
    lambda t: t == ":",
    lambda t: t == "{",  # the arguments object opens
]
_NAME_STEP, _COMMIT_STEP = 3, 6


def _read_header(text: str) -> tuple[int, str | None, int] | None:
    """How far `text` follows `{"name": "<name>", "arguments": {`: (tokens matched, the name
    once read, where the arguments object starts or -1), or None once it departs from it."""
    name = None
    steps = 0
    for (token, end), check in zip(_tokens(text), _HEADER, strict=False):
        if not check(token):
            return None
        if steps == _NAME_STEP:
            name = _string(token)
        steps += 1
        if steps == len(_HEADER):
            return steps, name, end - 1
    return steps, name, -1


class CallReader:
    """One JSON call object read as it arrives.

    ToolCallStart goes out once `{"name": "...", "arguments"` has been read (the arguments key
    tells a call from any JSON that has a "name"); the arguments object then streams as it
    comes. Objects laid out otherwise (arguments first, keys in between, arguments as a JSON
    string) are judged whole when they close. Before ToolCallStart, a malformed object sets
    `failed` and its text so far, `raw`, is the caller's to emit as text; after it the call
    cannot be taken back and always ends with ToolCallEnd.
    """

    def __init__(self, start_call: Callable[[str], ToolCallStart]) -> None:
        self._start_call = start_call
        self._start: ToolCallStart | None = None
        self._object: JsonScanner | None = None  # created at the opening brace
        self._header = True  # still reading the name-first layout
        self._args: ArgsStream | None = None
        self.raw = ""  # the object's text up to where the arguments start streaming
        self.done = False
        self.failed = False

    @property
    def committed(self) -> bool:
        return self._start is not None

    def feed(self, text: str) -> tuple[list[OutputPart], int]:
        """Parts for `text` and how much of it belongs to this object."""
        used = 0
        if self._object is None:
            rest = text.lstrip()
            used = len(text) - len(rest)
            self.raw += text[:used]
            if not rest:
                return [], used
            if rest[0] != "{":
                self.failed = True
                return [], used
            self._object = JsonScanner()
        end = self._object.scan(text[used:])
        new = text[used:] if end < 0 else text[used : used + end]
        if self._args is None:
            self.raw += new
            parts = self._read_header()
        else:
            parts = self._stream(new)
        if end >= 0:
            parts += self._close()
        return parts, used + len(new)

    def cut(self) -> list[OutputPart]:
        """The input ended inside a committed call's object."""
        return self._end(None if self._args else "{}")

    def _read_header(self) -> list[OutputPart]:
        if not self._header:
            return []
        header = _read_header(self.raw)
        if header is None:
            self._header = False
            return []
        steps, name, args_at = header
        parts: list[OutputPart] = []
        if self._start is None and steps >= _COMMIT_STEP and name:
            self._start = self._start_call(name)
            parts.append(self._start)
        if args_at >= 0 and self._start is not None:
            self._header = False
            self._args = ArgsStream(self._start.index)
            parts += self._stream(self.raw[args_at:])
        return parts

    def _stream(self, text: str) -> list[OutputPart]:
        """Argument text; what follows the arguments in the object is ignored."""
        assert self._args is not None
        return [] if self._args.done else self._args.feed(text)[0]

    def _close(self) -> list[OutputPart]:
        """The object closed: the call's remaining parts, or `failed`."""
        if self._args is not None:
            self.done = True
            return self._end(None)
        call = parse_call(self.raw)
        if self._start is not None:
            self.done = True
            return self._end(call[1] if call else "{}")
        if call is None:
            self.failed = True
            return []
        self.done = True
        self._start = self._start_call(call[0])
        return [self._start, *self._end(call[1])]

    def _end(self, arguments: str | None) -> list[OutputPart]:
        assert self._start is not None
        index = self._start.index
        parts: list[OutputPart] = [] if arguments is None else [ToolCallArgs(index, arguments)]
        return [*parts, ToolCallEnd(index)]
