"""The tool-call formats mlx-lm already parses (`mlx_lm.tool_parsers`), streamed.

Each mlx-lm module names its markers (`tool_call_start`, `tool_call_end`) and parses the text
between them whole (`parse_tool_call(text, tools)` → {name, arguments} or a list of them).
This wrapper adds what mlx-lm leaves to its server: text outside the markers streams as it
comes (a possible marker prefix is held back), and each block becomes our call parts as soon
as its end marker arrives. Arguments therefore arrive in one fragment per call; the formats
we write ourselves (hermes, qwen3_coder, mistral, llama3_json) stream them piece by piece.
"""

from __future__ import annotations

import importlib
import json
from types import ModuleType
from typing import Any

from mlxd.parsers._stream import BufferedParser
from mlxd.parsers.base import TextPart, ToolCallArgs, ToolCallEnd

# Our name → mlx-lm module. mlx-lm's own names (its `tool_parser_type`), plus the short names
# vLLM users type. json_tools, qwen3_coder and mistral are not here: mlxd's own parsers of
# those formats stream arguments incrementally.
MLX_LM_FORMATS = {
    "function_gemma": "function_gemma",
    "gemma4": "gemma4",
    "gemma": "gemma4",
    "glm47": "glm47",
    "glm45": "glm47",
    "kimi_k2": "kimi_k2",
    "kimi": "kimi_k2",
    "kimi_k3": "kimi_k3",
    "laguna": "laguna",
    "longcat": "longcat",
    "minicpm5": "minicpm5",
    "minimax_m2": "minimax_m2",
    "minimax": "minimax_m2",
    "muse_spark": "muse_spark",
    "pythonic": "pythonic",
}


def mlx_lm_module(name: str) -> ModuleType:
    return importlib.import_module(f"mlx_lm.tool_parsers.{MLX_LM_FORMATS[name]}")


class MlxLmToolParser(BufferedParser):
    """Streams one mlx-lm format. `tools` (the request's) lets formats that type their
    arguments by the tool's schema (glm47, minimax_m2) do so."""

    def __init__(self, name: str, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__()
        module = mlx_lm_module(name)
        self._parse = module.parse_tool_call
        self._start_marker: str = module.tool_call_start
        self._end_marker: str = module.tool_call_end
        self._tools = tools
        self._inside = False

    def _step(self) -> bool:
        if not self._inside:
            if self._until([self._start_marker]) is None:
                return False
            self._inside = True
            return True
        end = self._buf.find(self._end_marker)
        if end < 0 and not self._eof:
            return False
        # As mlx-lm's server does, a block the generation ended inside is still parsed: the
        # end marker is often a special token that stops generation before it is written.
        body, closed = (self._buf, False) if end < 0 else (self._buf[:end], True)
        self._buf = "" if end < 0 else self._buf[end + len(self._end_marker) :]
        self._inside = False
        self._calls_from(body, self._end_marker if closed else "")
        return True

    def _calls_from(self, body: str, tail: str) -> None:
        calls = self._read(body)
        if not calls:  # not a call after all: the model's text, markers included
            self._emit(TextPart, self._start_marker + body + tail)
            return
        for call in calls:
            start = self._start_call(call["name"])
            arguments = call.get("arguments") or {}
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            self._out += [start, ToolCallArgs(start.index, arguments), ToolCallEnd(start.index)]
        self._trim = True

    def _read(self, body: str) -> list[dict[str, Any]]:
        """The calls in `body`, or [] when mlx-lm cannot read it (its parsers raise any kind
        of error on malformed text: model output must never fail a request)."""
        try:
            parsed = self._parse(body, self._tools)
        except Exception:
            return []
        calls = parsed if isinstance(parsed, list) else [parsed]
        named = all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls)
        return calls if calls and named else []
