"""Parser names (the YAML `parsers:` section) → parser instances, and chaining the two.

Parsers keep per-response state: make new ones for every response (and every choice).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial

from mlxd.parsers.base import OutputPart, StreamParser, TextPart
from mlxd.parsers.harmony import HarmonyParser
from mlxd.parsers.hermes import HermesParser
from mlxd.parsers.llama3_json import PYTHON_TAG, Llama3JsonParser
from mlxd.parsers.mistral import MARKER as MISTRAL_MARKER
from mlxd.parsers.mistral import MistralParser
from mlxd.parsers.mlx_lm_formats import MLX_LM_FORMATS, MlxLmToolParser
from mlxd.parsers.qwen3_coder import FUNCTION, Qwen3CoderParser
from mlxd.parsers.qwen3_coder import OPEN as TOOL_CALL
from mlxd.parsers.reasoning import ThinkParser

TOOL_PARSERS: dict[str, Callable[[], StreamParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    **{name: partial(MlxLmToolParser, name) for name in MLX_LM_FORMATS},
}
# Reasoning parser names users know from vLLM / mlx-lm, all `<think>…</think>`. `starts_inside`
# (the prompt opened the block) comes from the caller; deepseek_r1 assumes it, as vLLM's R1
# parser does: R1 templates open the block themselves and the model only closes it (a
# `<think>` the model writes anyway is dropped).
REASONING_PARSERS: dict[str, Callable[[bool], StreamParser]] = {
    "think": ThinkParser,
    "qwen3": ThinkParser,
    "deepseek_r1": lambda starts_inside: ThinkParser(starts_inside=True),
    "gpt_oss": HarmonyParser,  # Harmony channels, not think tags
}
# What `parsers.tool_calls` accepts: a parser, or "auto" (the one the chat template teaches).
TOOL_PARSER_NAMES = ["auto", *TOOL_PARSERS]

# Llama 3.1-3.3 templates describe calls as `{"name": function name, "parameters": dictionary …}`.
_LLAMA3_INSTRUCTIONS = re.compile(r'"parameters":\s*dictionary')
# mlx-lm's names for the formats mlxd parses with its own parsers.
_OURS = {"json_tools": "hermes", "qwen3_coder": "qwen3_coder", "mistral": "mistral"}


def detect_tool_format(chat_template: str | None, loaded_format: str | None = None) -> str | None:
    """The tool-call format a chat template teaches its model, if any: the one mlx-lm's loader
    found for the model's tokenizer first (`loaded_format`, named as in `mlx_lm.tool_parsers`:
    it tells apart the formats that share `<tool_call>`: glm47, qwen3_coder, hermes), then
    mlxd's own checks of the template."""
    template = chat_template or ""
    inferred = loaded_format
    if inferred in _OURS:
        return _OURS[inferred]
    if inferred in MLX_LM_FORMATS:
        return inferred
    if TOOL_CALL in template:
        return "qwen3_coder" if FUNCTION in template else "hermes"
    if MISTRAL_MARKER in template:
        return "mistral"
    if PYTHON_TAG in template or _LLAMA3_INSTRUCTIONS.search(template):
        return "llama3_json"
    return None


def make_tool_parser(
    name: str | None,
    chat_template: str | None = None,
    tools: list[dict] | None = None,
    loaded_format: str | None = None,
) -> StreamParser | None:
    """A fresh tool-call parser; "auto" picks it as `detect_tool_format` does (None if there
    is no known format). `tools` (the request's) helps the mlx-lm formats that type arguments by
    schema. Raises ValueError for an unknown name."""
    if name == "auto":
        name = detect_tool_format(chat_template, loaded_format)
    if name is None:
        return None
    if name not in TOOL_PARSERS:
        valid = ", ".join(TOOL_PARSER_NAMES)
        raise ValueError(f"unknown tool-call parser {name!r}; valid: {valid}")
    if name in MLX_LM_FORMATS:
        return MlxLmToolParser(name, tools)
    return TOOL_PARSERS[name]()


def make_reasoning_parser(name: str | None, starts_inside: bool = False) -> StreamParser | None:
    """A fresh reasoning parser. `starts_inside`: the prompt already opened the think block
    (see `reasoning.prompt_opens_reasoning`). Raises ValueError for an unknown name."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        valid = ", ".join(REASONING_PARSERS)
        raise ValueError(f"unknown reasoning parser {name!r}; valid: {valid}")
    return REASONING_PARSERS[name](starts_inside)


class _PassThrough:
    def feed(self, text: str) -> list[OutputPart]:
        return [TextPart(text)] if text else []

    def finish(self) -> list[OutputPart]:
        return []


class _Chain:
    """Reasoning first; the tool parser sees only the text outside the reasoning."""

    def __init__(self, tool: StreamParser, reasoning: StreamParser) -> None:
        self._tool = tool
        self._reasoning = reasoning

    def feed(self, text: str) -> list[OutputPart]:
        return self._route(self._reasoning.feed(text))

    def finish(self) -> list[OutputPart]:
        return self._route(self._reasoning.finish()) + self._tool.finish()

    def _route(self, parts: list[OutputPart]) -> list[OutputPart]:
        out: list[OutputPart] = []
        for part in parts:
            out += self._tool.feed(part.text) if isinstance(part, TextPart) else [part]
        return out


def compose(tool: StreamParser | None, reasoning: StreamParser | None) -> StreamParser:
    """One parser for a response: reasoning split off first, then tool calls in the text."""
    if tool is not None and reasoning is not None:
        return _Chain(tool, reasoning)
    return tool or reasoning or _PassThrough()
