"""OpenAI request bodies, validated with pydantic. Unknown fields are ignored, as clients
such as Open WebUI send extras; known fields are checked strictly."""

from __future__ import annotations

from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict"}


class SamplingFields(_Lenient):
    """Fields shared by chat and text completions."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    # The sampler's key is 64 bits; int64 and uint64 seeds both fit (see sampling.py).
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Sequences per prompt, decoded together in one batch.
    n: int = Field(default=1, ge=1, le=16)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    repetition_context_size: int | None = Field(default=None, ge=1)
    logit_bias: dict[int, float] | None = None
    user: str | None = None
    # swift-mlx-server's fields mlxd refuses (see api/common/generation.py UNHONOURED_FIELDS): named
    # here so that setting one is seen, not dropped with the unknown extras.
    kv_bits: Any = None
    kv_group_size: Any = None
    kv_quantization_start: Any = None
    resize: Any = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        stops = [value] if isinstance(value, str) else value
        if stops is not None and len(stops) > 16:
            raise ValueError("at most 16 stop sequences")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if value and any(not -100 <= v <= 100 for v in value.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        return value


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    # vLLM's extension (the openai SDK sends it through `extra_body`).
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            if len(value) > 16:
                raise ValueError("at most 16 prompts per request")
            if any(not p for p in value):
                raise ValueError("prompts must not be empty")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: one string or one token list is a list of one."""
        value = self.prompt
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            return list(value)
        # One prompt: a string or a token list (mypy cannot narrow lists by their first item).
        return [cast(str | list[int], value)]


class EmbeddingRequest(_Lenient):
    model: str = Field(min_length=1)
    # Token ids are the model's own, without special tokens (the model adds those).
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    batch_size: Any = None  # swift-mlx-server's; refused (see UNHONOURED_FIELDS)

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if not value:
            raise ValueError("input must not be empty")
        if isinstance(value, list) and isinstance(value[0], str | list):
            empty = next((i for i, item in enumerate(value) if not item), None)
            if empty is not None:
                raise ValueError(f"input[{empty}] is empty")
        return value

    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs as a list: one string or one token list becomes a list of one."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [value]
        # Strings or token lists (mypy cannot narrow lists by their first item).
        return cast(list[str] | list[list[int]], value)
