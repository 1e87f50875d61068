"""Ollama request bodies (its docs/api.md and the `ollama` Python client's `_types.py`).

Unknown fields are ignored: Ollama clients send options mlxd has no use for (num_gpu,
mirostat, ...) and Ollama itself accepts them. Fields mlxd cannot honour in a way the
caller would expect (`template`, `suffix`, `context`) are 400s in the route, not silently
dropped.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mlxd.config.units import parse_duration


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Options(_Lenient):
    """The Modelfile parameters mlxd maps; the rest (num_gpu, num_thread, mirostat…) are
    runtime knobs of llama.cpp with no meaning here and are accepted and ignored."""

    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    # Ollama: -1 generates until the context is full, -2 until it is full (with shifting).
    num_predict: int | None = Field(default=None, ge=-2)
    stop: list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    repeat_penalty: float | None = Field(default=None, gt=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    # The context is the model's (YAML context_length); a client's num_ctx cannot grow it.
    num_ctx: int | None = Field(default=None, ge=1)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class ToolCallFunction(_Lenient):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class ToolCall(_Lenient):
    function: ToolCallFunction


class Message(_Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None
    images: list[str] | None = None  # base64, no data: prefix
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None


KeepAlive = float | str | None


class _Generating(_Lenient):
    model: str = Field(min_length=1)
    stream: bool = True
    options: Options = Field(default_factory=Options)
    format: Literal["", "json"] | dict[str, Any] | None = None
    keep_alive: KeepAlive = None
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class ChatRequest(_Generating):
    # An empty list loads (or, with keep_alive 0, unloads) the model and generates nothing.
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Generating):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None
    template: str | None = None
    suffix: str | None = None
    context: list[int] | None = None


class EmbedRequest(_Lenient):
    model: str = Field(min_length=1)
    input: str | list[str]
    truncate: bool | None = None
    dimensions: int | None = Field(default=None, ge=1)
    keep_alive: KeepAlive = None

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and (not value or any(not item for item in value)):
            raise ValueError("input must be a string or a list of non-empty strings")
        return value


class EmbeddingsRequest(_Lenient):
    """The older /api/embeddings: one `prompt`, one `embedding` back."""

    model: str = Field(min_length=1)
    prompt: str = Field(min_length=1)
    keep_alive: KeepAlive = None


class PullRequest(_Lenient):
    # Older clients send `name`.
    model: str | None = None
    name: str | None = None
    stream: bool = True
    insecure: bool = False


class ShowRequest(_Lenient):
    # Older clients send `name`.
    model: str | None = None
    name: str | None = None
    verbose: bool = False


def keep_alive_seconds(value: KeepAlive) -> float | None:
    """Ollama's keep_alive in seconds: a number of seconds or a Go duration ("5m", "1h30m");
    negative keeps the model loaded (math.inf); None leaves the model's setting alone."""
    if value is None or value == "":
        return None
    if isinstance(value, str) and value.strip().startswith("-"):
        return math.inf
    if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
        return math.inf
    try:
        return parse_duration(value)
    except Exception as exc:  # PydanticCustomError: a plain message for the caller
        raise ValueError(f"keep_alive: {exc}") from None
