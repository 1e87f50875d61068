"""OpenAI Responses API request body (`POST /v1/responses`), validated with pydantic.

Fields mlxd acts on are typed strictly; the many others the API accepts (`metadata`,
`include`, `truncation`, `service_tier`, `prompt_cache_key`, `user`, …) are ignored, so a
current SDK's request is never a 400 for carrying them. Input items stay dicts: their many
types are read (and rejected with a precise param) by `mlxd.api.responses_input`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(_Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Lenient):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(_Lenient):
    effort: str | None = None
    summary: str | None = None


class ResponseCreateRequest(_Lenient):
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None
