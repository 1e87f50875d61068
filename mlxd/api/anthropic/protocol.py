"""Anthropic Messages request bodies, and their translation to mlxd's internal (OpenAI-shaped)
messages and tools. Written against the `anthropic` SDK's MessageCreateParams (2.x). Fields
that change nothing locally (cache_control on any block, context_management, metadata,
service_tier, container, speed, ...) are accepted and ignored; fields mlxd acts on are checked
strictly."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, model_validator

from mlxd.errors import InvalidRequest


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Lenient):
    type: Literal["text"]
    text: str


class Base64Source(_Lenient):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLSource(_Lenient):
    type: Literal["url"]
    url: str


class ImageBlock(_Lenient):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


class ThinkingBlock(_Lenient):
    """Earlier turns' reasoning, as clients send it back; not replayed to the model (chat
    templates drop past reasoning too)."""

    type: Literal["thinking", "redacted_thinking"]


class DocumentBlock(_Lenient):
    """A document: plain text (`text` source, or `content` text blocks) is read as text;
    PDFs (`base64` / `url` sources) need a document parser mlxd does not have."""

    type: Literal["document"]
    source: dict[str, Any]
    title: str | None = None
    context: str | None = None

    def text(self, param: str) -> str:
        kind = self.source.get("type")
        if kind == "text" and isinstance(self.source.get("data"), str):
            body = self.source["data"]
        elif kind == "content" and isinstance(self.source.get("content"), (str, list)):
            content = self.source["content"]
            body = (
                content
                if isinstance(content, str)
                else "\n".join(b.get("text", "") for b in content if isinstance(b, dict))
            )
        else:
            raise InvalidRequest(
                f"documents with a '{kind}' source (PDF) are not supported; send the text",
                param=param,
            )
        return "\n".join(part for part in (self.title, self.context, body) if part)


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | DocumentBlock,
    Field(discriminator="type"),
]


class Message(_Lenient):
    # "system" messages may stand anywhere among the turns (the SDK's SystemMessageParam).
    role: Literal["user", "assistant", "system"]
    # Only a system message may omit it (the beta's per-turn output_config-only message).
    content: str | list[ContentBlock] | None = None
    # Beta, system messages: "next_user_message" shows it only until the next user turn.
    clear_at: Literal["next_user_message", "never"] | None = None

    @model_validator(mode="after")
    def _content_required(self) -> Message:
        if self.content is None and self.role != "system":
            raise ValueError("content: Field required")
        return self


class Tool(_Lenient):
    """A client tool. Anthropic's server and versioned tools (`web_search_20250305`,
    `bash_20250124`, ...) carry a `type` and no schema: mlxd cannot run them or describe them
    to the model, so they are left out of the prompt rather than refused."""

    name: str = Field(min_length=1)
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _client_tool_needs_schema(self) -> Tool:
        if self.is_client_tool and self.input_schema is None:
            raise ValueError("input_schema: Field required")
        return self

    @property
    def is_client_tool(self) -> bool:
        return self.type in (None, "custom")


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _tool_needs_name(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs a name")
        return self


class ThinkingEnabled(_Lenient):
    type: Literal["enabled"]
    # The API wants >= 1024; mlxd cannot cap reasoning separately, so any budget is accepted.
    budget_tokens: int = Field(ge=0)
    display: Literal["summarized", "omitted"] | None = None


class ThinkingOther(_Lenient):
    type: Literal["adaptive", "disabled", "between_tools"]
    display: Literal["summarized", "omitted"] | None = None


Thinking = Annotated[ThinkingEnabled | ThinkingOther, Field(discriminator="type")]


class JsonOutputFormat(_Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Lenient):
    # Accepted: effort is how long Claude thinks; a local model's reasoning is its own.
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class Metadata(_Lenient):
    user_id: str | None = None


class CountTokensRequest(_Lenient):
    """`POST /v1/messages/count_tokens`: everything that shapes the prompt."""

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    # Whether a model reasons is its YAML `parsers.reasoning`; this says whether to show it.
    thinking: Thinking | None = None
    # Accepted, changes nothing: mlxd keeps every turn it is sent (no server-side edits).
    context_management: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`."""

    # 0 pre-warms the prompt cache: the prompt is prefilled, nothing is generated.
    max_tokens: int = Field(ge=0)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    # The structured-outputs beta's spelling of output_config.format.
    output_format: JsonOutputFormat | None = None
    stream: bool = False

    def response_format(self) -> dict[str, Any] | None:
        """The JSON schema the answer must follow, in GenerationRequest's form."""
        spec = self.output_config.format if self.output_config else None
        spec = spec or self.output_format
        return None if spec is None else {"type": "json_schema", "schema": spec.schema_}

    def shows_thinking(self) -> bool:
        """Whether reasoning the model does comes back as thinking blocks."""
        thinking = self.thinking
        return thinking is None or (thinking.type != "disabled" and thinking.display != "omitted")


class MessagesBatchList(RootModel[list[MessagesRequest]]):
    """`POST /v1/messages/batch`: a JSON list of Messages requests (documentation only: the
    route validates each item on its own, so one bad item fails alone)."""


def prompt_fields(body: CountTokensRequest) -> dict[str, Any]:
    """The `GenerationRequest` fields that make the prompt: messages, tools, tool choice."""
    choice = tool_choice(body.tool_choice, body.tools)
    return {
        "messages": internal_messages(body.system, body.messages),
        # "none" keeps the tools out of the prompt, as the OpenAI route does.
        "tools": None if choice == "none" else internal_tools(body.tools),
        "tool_choice": choice,
        "parallel_tool_calls": not (
            body.tool_choice and body.tool_choice.disable_parallel_tool_use
        ),
    }


def internal_messages(
    system: str | list[TextBlock] | None, messages: list[Message]
) -> list[dict[str, Any]]:
    """Anthropic turns as OpenAI-style messages: `system` leads; system-role messages stay
    where they stand (the renderer folds them into the first if the template objects); an
    assistant's tool_use blocks become its `tool_calls`; each tool_result becomes a `tool`
    message, placed where it stood among the user's blocks. A final assistant turn is a
    prefill: it is marked `prefix` so the renderer continues it instead of opening a new one."""
    result: list[dict[str, Any]] = []
    system_text = _text(system)
    if system_text:
        result.append({"role": "system", "content": system_text})
    for index, message in enumerate(messages):
        if message.role == "system":
            text = _system_text(message.content, index)
            if text and not _cleared(message, messages[index + 1 :]):
                result.append({"role": "system", "content": text})
        elif message.content is None or isinstance(message.content, str):
            result.append({"role": message.role, "content": message.content or ""})
        elif message.role == "assistant":
            result.append(_assistant(message.content))
        else:
            result.extend(_user(message.content, index))
    last = result[-1] if result else None
    if last and last["role"] == "assistant" and not last.get("tool_calls"):
        last["prefix"] = True
    return result


def prefill_text(messages: list[dict[str, Any]]) -> str | None:
    """The text a prefilled (final, `prefix`) assistant turn ends with; None without one."""
    last = messages[-1] if messages else {}
    if not last.get("prefix"):
        return None
    content = last.get("content") or ""
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def _text(content: str | list[TextBlock] | None) -> str:
    return content if isinstance(content, str) else "\n".join(b.text for b in content or [])


def _cleared(message: Message, later: list[Message]) -> bool:
    return message.clear_at == "next_user_message" and any(m.role == "user" for m in later)


def _system_text(content: str | list[ContentBlock] | None, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = [block for block in content if isinstance(block, TextBlock)]
    if len(texts) != len(content):
        raise InvalidRequest(
            "system messages hold text blocks only", param=f"messages.{index}.content"
        )
    return _text(texts)


def _assistant(blocks: list[ContentBlock]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": arguments},
                }
            )
        elif not isinstance(block, ThinkingBlock):
            raise InvalidRequest(
                f"assistant messages cannot hold '{block.type}' blocks", param="messages"
            )
    message: dict[str, Any] = {"role": "assistant", "content": parts}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[ContentBlock], index: int) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for position, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            parts.append(_image_part(block, f"messages[{index}].content[{position}]"))
        elif isinstance(block, DocumentBlock):
            text = block.text(f"messages.{index}.content.{position}")
            parts.append({"type": "text", "text": text})
        elif isinstance(block, ToolResultBlock):
            if parts:
                result.append({"role": "user", "content": parts})
                parts = []
            result.append(
                {"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block)}
            )
        elif not isinstance(block, ThinkingBlock):
            raise InvalidRequest(
                f"user messages cannot hold '{block.type}' blocks", param="messages"
            )
    if parts:
        result.append({"role": "user", "content": parts})
    return result


def _image_part(block: ImageBlock, param: str) -> dict[str, Any]:
    """The internal (OpenAI-shaped) image part; `param` keeps the caller's place for errors."""
    source = block.source
    url = (
        f"data:{source.media_type};base64,{source.data}"
        if isinstance(source, Base64Source)
        else source.url
    )
    return {"type": "image_url", "image_url": {"url": url}, "param": param}


def _result_text(block: ToolResultBlock) -> str:
    content = block.content
    text = content if isinstance(content, str) else "\n".join(b.text for b in content)
    # Tool messages have no error flag; say it in the text so the model can react to it.
    return f"Error: {text}" if block.is_error else text


def internal_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    result = []
    for tool in tools or []:
        if not tool.is_client_tool:
            continue
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        result.append({"type": "function", "function": function})
    return result or None


def tool_choice(choice: ToolChoice | None, tools: list[Tool] | None) -> str | dict[str, Any] | None:
    """Anthropic's tool_choice in the internal form: any → "required", tool → {"name"}."""
    if choice is None:
        return None
    names = {tool.name for tool in tools or [] if tool.is_client_tool}
    if choice.type == "tool":
        if choice.name not in names:
            raise InvalidRequest(
                f"tool_choice names '{choice.name}', which is not in tools", param="tool_choice"
            )
        return {"name": choice.name}
    if choice.type == "any":
        if not names:
            raise InvalidRequest("tool_choice 'any' needs tools", param="tool_choice")
        return "required"
    return choice.type
