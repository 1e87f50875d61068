"""Streaming parsers that turn a model's text into text, reasoning and tool-call parts."""

from mlxd.parsers.reasoning import prompt_opens_reasoning
from mlxd.parsers.registry import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    compose,
    detect_tool_format,
    make_reasoning_parser,
    make_tool_parser,
)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "compose",
    "detect_tool_format",
    "make_reasoning_parser",
    "make_tool_parser",
    "prompt_opens_reasoning",
]
