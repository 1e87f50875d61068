"""gpt-oss's Harmony channels as reasoning and text.

After the prompt's `<|start|>assistant`, gpt-oss writes messages such as
`<|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final<|message|>…<|return|>`.
The `analysis` channel is the reasoning; `final` (and `commentary` preambles) are the answer.
Headers and the special tokens between messages are dropped. Tool calls addressed in a header
(`to=functions.x`) are not parsed here: their text comes out as text.
"""

from __future__ import annotations

from mlxd.parsers._stream import BufferedParser
from mlxd.parsers.base import ReasoningPart, TextPart

CHANNEL, MESSAGE, START = "<|channel|>", "<|message|>", "<|start|>"
MESSAGE_ENDS = ("<|end|>", "<|return|>", "<|call|>")
REASONING_CHANNEL = "analysis"


class HarmonyParser(BufferedParser):
    def __init__(self, starts_inside: bool = False) -> None:
        super().__init__()
        self._kind: type[TextPart] | type[ReasoningPart] = TextPart
        self._in_header = False

    def _step(self) -> bool:
        if self._in_header:
            return self._read_header()
        marker = self._until([CHANNEL, START, *MESSAGE_ENDS], self._kind)
        if marker is None:
            return False
        if marker in (CHANNEL, START):
            self._in_header = True  # `<|start|>assistant<|channel|>…` or `<|channel|>…`
            self._buf = (CHANNEL if marker == CHANNEL else "") + self._buf
        else:
            self._kind, self._trim = TextPart, True
        return True

    def _read_header(self) -> bool:
        end = self._buf.find(MESSAGE)
        if end < 0:
            if not self._eof:
                return False
            self._buf, self._in_header = "", False  # a header the generation cut: nothing said
            return True
        header, self._buf = self._buf[:end], self._buf[end + len(MESSAGE) :]
        channel = header.partition(CHANNEL)[2].split()
        reasoning = bool(channel) and channel[0] == REASONING_CHANNEL
        self._kind = ReasoningPart if reasoning else TextPart
        self._in_header, self._trim = False, True
        return True
