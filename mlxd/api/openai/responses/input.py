"""Responses API input items → the internal (OpenAI chat shaped) messages.

The Responses API speaks in items: messages whose content parts are `input_text`,
`input_image` (and, echoed back from an earlier answer, `output_text`), plus
`function_call` / `function_call_output` items that carry a tool round trip outside any
message. Internally a call belongs to the assistant message that made it and its result is a
`tool` message, as chat templates expect; this module does that folding. Anything the model
cannot use is a 400 naming the item, never silently dropped.
"""

from __future__ import annotations

from typing import Any

from mlxd.errors import InvalidRequest

# Item types that carry no input the model can read and that clients send back verbatim
# from an earlier answer: skipped (a model re-derives its reasoning every turn).
SKIPPED_ITEMS = frozenset({"reasoning"})
TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text"})


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as an item list: a string is one user message."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return value


def messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """The internal messages for `items`, with `instructions` as the system prompt first."""
    result: list[dict[str, Any]] = []
    if instructions:
        result.append({"role": "system", "content": instructions})
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidRequest("input items must be objects", param=f"input[{index}]")
        kind = item.get("type", "message")
        if kind == "message":
            result.append(_message(item, index))
        elif kind == "function_call":
            _function_call(result, item, index)
        elif kind == "function_call_output":
            result.append(_function_call_output(item, index))
        elif kind not in SKIPPED_ITEMS:
            raise InvalidRequest(
                f"input item type '{kind}' is not supported by mlxd (messages, function_call "
                "and function_call_output are)",
                param=f"input[{index}].type",
            )
    if not any(m["role"] in ("user", "tool") for m in result):
        raise InvalidRequest("input holds no user message or function_call_output", param="input")
    return result


def _message(item: dict[str, Any], index: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise InvalidRequest(
            f"message role must be user, assistant, system or developer, not {role!r}",
            param=f"input[{index}].role",
        )
    # Chat templates know `system`; `developer` is OpenAI's newer name for the same turn.
    role = "system" if role == "developer" else role
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise InvalidRequest(
            "message content must be a string or a list of parts", param=f"input[{index}].content"
        )
    parts = [_part(part, f"input[{index}].content[{i}]", role) for i, part in enumerate(content)]
    if role != "user":
        # Only user turns may hold images; the others are plain text for every template.
        return {"role": role, "content": "".join(part["text"] for part in parts)}
    return {"role": role, "content": parts}


def _part(part: Any, param: str, role: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS or kind == "refusal":
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise InvalidRequest(f"a '{kind}' part needs text", param=param)
        return {"type": "text", "text": text}
    if kind == "input_image" and role == "user":
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise InvalidRequest(
                "input_image needs image_url (a data: URL or, where allowed, an http(s) or "
                "file URL); file_id is not supported",
                param=f"{param}.image_url",
            )
        # `param` keeps the caller's place for media errors (see mlxd.media).
        return {"type": "image_url", "image_url": {"url": url}, "param": param}
    raise InvalidRequest(f"content part type {kind!r} is not supported here", param=param)


def _function_call(result: list[dict[str, Any]], item: dict[str, Any], index: int) -> None:
    """A call joins the assistant message just before it (the one that made it), or starts one."""
    call_id, name = item.get("call_id"), item.get("name")
    arguments = item.get("arguments", "")
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, str):
        raise InvalidRequest(
            "function_call needs call_id, name and arguments (a JSON string)",
            param=f"input[{index}]",
        )
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if not result or result[-1]["role"] != "assistant":
        result.append({"role": "assistant", "content": ""})
    result[-1].setdefault("tool_calls", []).append(call)


def _function_call_output(item: dict[str, Any], index: int) -> dict[str, Any]:
    call_id, output = item.get("call_id"), item.get("output")
    if isinstance(output, list):
        texts = [p.get("text") for p in output if isinstance(p, dict)]
        output = "".join(t for t in texts if isinstance(t, str))
    if not isinstance(call_id, str) or not isinstance(output, str):
        raise InvalidRequest(
            "function_call_output needs call_id and output (a string or text parts)",
            param=f"input[{index}]",
        )
    return {"role": "tool", "tool_call_id": call_id, "content": output}
