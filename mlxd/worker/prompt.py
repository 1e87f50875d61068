"""Chat messages (+ tools) → prompt token ids, with the model's own chat template.

Tools go through the template's `tools=` when it knows about tools. A template without tool
support (SmolLM2's, for one) gets the Hermes convention instead, the most widely trained
one: tool signatures in the system prompt, calls as `<tool_call>{json}</tool_call>` and
results as `<tool_response>` turns; the output is then parsed with the hermes parser.

A final assistant message marked `"prefix": true` is a prefill: it is rendered without a new
generation prompt (`continue_final_message`), so the model continues that turn. System
messages after the first stay in place unless the template rejects them; then they are
folded, in order, into the leading system message.
"""

from __future__ import annotations

import json
from typing import Any

from mlxd.errors import InvalidRequest
from mlxd.media import IMAGE_TYPES
from mlxd.types import RENDER_ARGUMENTS

HERMES_SYSTEM = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_supports_tools(chat_template: str | None) -> bool:
    return chat_template is not None and "tools" in chat_template


def loaded_tool_format(tokenizer: Any) -> str | None:
    """The tool-call format mlx-lm's loader inferred for a tokenizer: the module of the
    wrapper's `tool_parser`, named as in `mlx_lm.tool_parsers` (None where it found none)."""
    module: str = getattr(getattr(tokenizer, "tool_parser", None), "__module__", None) or ""
    package = "mlx_lm.tool_parsers."
    return module.removeprefix(package) if module.startswith(package) else None


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list | None,
    model: str,
    *,
    images: bool = False,
    tokenize: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> Any:
    """Prompt token ids (or text, `tokenize=False`). With `images` (vision models), image parts
    stay in the content as `{"type": "image"}` for the template to mark their place.
    `template_kwargs` become template variables (chat_template_kwargs). The prefix cache keys
    on the token ids this returns, so a render that differs by its kwargs is another cache
    key by construction: nothing to add to the key."""
    template_kwargs = template_kwargs or {}
    if reserved := sorted(RENDER_ARGUMENTS & template_kwargs.keys()):
        raise InvalidRequest(
            f"chat_template_kwargs may not set {', '.join(reserved)}: mlxd sets it",
            param="chat_template_kwargs",
        )
    messages = [_with_images(m) if images else _flatten(m, model) for m in messages]
    messages, prefill = _split_prefill(messages)
    if not tokenizer.has_chat_template:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        text += f"assistant: {prefill['content']}" if prefill else "assistant:"
        return tokenizer.encode(text)
    uses_tools = bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if uses_tools and template_supports_tools(tokenizer.chat_template):
        messages = [_structured_calls(m) for m in messages]
    elif uses_tools:
        messages, tools = _hermes_messages(messages, tools or []), None
    if prefill:
        messages = [*messages, prefill]
    try:
        return _apply(tokenizer, messages, tools, prefill is not None, tokenize, template_kwargs)
    except Exception as exc:  # jinja raises for shapes the template rejects
        folded = _fold_system(messages)
        if folded != messages:
            try:
                return _apply(
                    tokenizer, folded, tools, prefill is not None, tokenize, template_kwargs
                )
            except Exception:
                pass  # report the first error: it names what the caller sent
        raise InvalidRequest(f"the chat template rejected the messages: {exc}") from exc


def _apply(
    tokenizer: Any,
    messages: list,
    tools: list | None,
    prefill: bool,
    tokenize: bool,
    template_kwargs: dict[str, Any],
) -> Any:
    return tokenizer.apply_chat_template(
        messages,
        tools=tools or None,
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        tokenize=tokenize,
        **template_kwargs,
    )


def _split_prefill(
    messages: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The messages before a prefilled final assistant turn, and that turn (None if there is
    none, or it is empty: nothing to continue, so a new turn is opened as usual)."""
    last = messages[-1] if messages else {}
    if last.get("role") != "assistant" or not last.get("prefix"):
        return messages, None
    rest = messages[:-1]
    content = last.get("content")
    if not content:
        return rest, None
    return rest, {"role": "assistant", "content": content}


def _fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every system message's text joined, in order, into one leading system message (for
    templates that accept a system message only first)."""
    system = [m for m in messages if m["role"] == "system"]
    if len(system) < 2 and (not system or messages[0] is system[0]):
        return messages
    text = "\n\n".join(_as_text(m.get("content")) for m in system)
    return [{"role": "system", "content": text}, *(m for m in messages if m["role"] != "system")]


def _as_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if part.get("type") == "text")
    return content or ""


def _flatten(message: dict[str, Any], model: str) -> dict[str, Any]:
    """String content: text models' templates concatenate it."""
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type")
            if kind != "text":
                raise InvalidRequest(
                    f"model '{model}' is a text-only model and does not accept images or other "
                    f"'{kind}' content (images need a `kind: vlm` model)",
                    param="messages",
                )
            parts.append(part.get("text", ""))
        content = "".join(parts)
    return {**message, "content": content or ""}


def _with_images(message: dict[str, Any]) -> dict[str, Any]:
    """List content with images kept in place; text-only content flattened as for text models."""
    content = message.get("content")
    if not isinstance(content, list) or all(p.get("type") == "text" for p in content):
        return _flatten(message, "")
    parts = []
    for part in content:
        kind = part.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind in IMAGE_TYPES:
            parts.append({"type": "image"})
        else:
            raise InvalidRequest(f"'{kind}' content is not supported", param="messages")
    return {**message, "content": parts}


def _structured_calls(message: dict[str, Any]) -> dict[str, Any]:
    # HF templates expect `arguments` as a mapping (they `tojson` it themselves).
    calls = message.get("tool_calls")
    if not calls:
        return message
    decoded = []
    for call in calls:
        function = dict(call.get("function", {}))
        function["arguments"] = _arguments(function.get("arguments"))
        decoded.append({**call, "function": function})
    return {**message, "tool_calls": decoded}


def _hermes_messages(messages: list[dict[str, Any]], tools: list) -> list[dict[str, Any]]:
    rendered = []
    for message in messages:
        if message.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n"
                + json.dumps(
                    {
                        "name": call["function"]["name"],
                        "arguments": _arguments(call["function"].get("arguments")),
                    }
                )
                + "\n</tool_call>"
                for call in message["tool_calls"]
            )
            text = f"{message['content']}\n{calls}" if message["content"] else calls
            rendered.append({"role": "assistant", "content": text})
        elif message["role"] == "tool":
            result = f"<tool_response>\n{message['content']}\n</tool_response>"
            rendered.append({"role": "user", "content": result})
        else:
            rendered.append({"role": message["role"], "content": message["content"]})
    if tools:
        signatures = "\n".join(json.dumps(tool) for tool in tools)
        instructions = HERMES_SYSTEM.format(tools=signatures)
        if rendered and rendered[0]["role"] == "system":
            first = rendered[0]
            rendered[0] = {**first, "content": f"{first['content']}\n\n{instructions}"}
        else:
            rendered.insert(0, {"role": "system", "content": instructions})
    return rendered


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments if arguments is not None else {}
