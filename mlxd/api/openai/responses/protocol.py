"""OpenAI Responses API request body (`POST /v1/responses`), validated with pydantic.

Fields mlxd acts on are typed strictly; the many others the API accepts (`metadata`,
`include`, `truncation`, `service_tier`, `prompt_cache_key`, `user`, …) are ignored, so a
current SDK's request is never a 400 for carrying them. Input items stay dicts: their many
types are read (and rejected with a precise param) by `mlxd.api.openai.responses.input`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class BuiltinTool(BaseModel):
    """One of OpenAI's hosted tools (web_search, file_search, …). Accepted so that clients
    which offer them by default still work, and not shown to the model, which cannot run
    them; it can only call function tools."""

    model_config = ConfigDict(extra="allow")
    type: str


def _tool_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "function" if kind == "function" else "builtin"


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[BuiltinTool, Tag("builtin")],
    Discriminator(_tool_kind),
]


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
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None

    def function_tools(self) -> list[FunctionTool]:
        return [tool for tool in self.tools or [] if isinstance(tool, FunctionTool)]
