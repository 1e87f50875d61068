"""The current Messages surface: fields of the `anthropic` SDK's MessageCreateParams that
Claude Code and other current clients send, translated to the internal request."""

from __future__ import annotations

from typing import Any

import pytest

from mlxd.api.anthropic.errors import anthropic_error, anthropic_status
from mlxd.api.anthropic.protocol import (
    MessagesRequest,
    internal_messages,
    prefill_text,
    prompt_fields,
)
from mlxd.errors import InvalidRequest, ModelLoadError, NotFound, Overloaded, Unavailable

CACHE = {"type": "ephemeral", "ttl": "1h"}
READ = {
    "name": "Read",
    "description": "Read a file.",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    "cache_control": CACHE,
    "strict": True,
}


def request(**fields: Any) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return MessagesRequest.model_validate({**body, **fields})


def test_every_current_optional_field_is_accepted():
    body = request(
        system=[{"type": "text", "text": "You are a CLI.", "cache_control": CACHE}],
        messages=[
            {"role": "system", "content": "Mode: plan"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
            },
        ],
        tools=[READ, {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}],
        thinking={"type": "adaptive", "display": "summarized"},
        output_config={"effort": "xhigh"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        metadata={"user_id": "user_abc_account_def_session_ghi"},
        cache_control={"type": "ephemeral"},
        service_tier="auto",
        speed="fast",
        inference_geo="eu",
        container=None,
        diagnostics={"previous_message_id": "msg_1"},
    )
    assert body.metadata.user_id.startswith("user_abc")
    assert body.response_format() is None and body.shows_thinking()


def test_system_role_messages_stay_in_order_after_the_system_prompt():
    body = request(
        system="top",
        messages=[
            {"role": "user", "content": "a"},
            {
                "role": "system",
                "content": [{"type": "text", "text": "mid", "cache_control": CACHE}],
            },
            {"role": "user", "content": "b"},
        ],
    )
    roles = [(m["role"], m["content"]) for m in internal_messages(body.system, body.messages)]
    assert roles == [("system", "top"), ("user", "a"), ("system", "mid"), ("user", "b")]


def test_system_message_cleared_at_the_next_user_turn_is_left_out():
    body = request(
        messages=[
            {"role": "user", "content": "a"},
            {"role": "system", "content": "once", "clear_at": "next_user_message"},
            {"role": "system", "content": "always", "clear_at": "never"},
            {"role": "system", "output_config": {"effort": "low"}},
            {"role": "user", "content": "b"},
            {"role": "system", "content": "still shown", "clear_at": "next_user_message"},
        ]
    )
    texts = [m["content"] for m in internal_messages(body.system, body.messages)]
    assert texts == ["a", "always", "b", "still shown"]


def test_only_system_messages_may_omit_content():
    with pytest.raises(ValueError, match="content"):
        request(messages=[{"role": "user"}])


def test_system_role_message_with_an_image_is_invalid():
    image = {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
    body = request(messages=[{"role": "system", "content": [image]}])
    with pytest.raises(InvalidRequest, match="system messages hold text blocks only"):
        internal_messages(body.system, body.messages)


def test_final_assistant_turn_is_a_prefill():
    body = request(
        messages=[
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": [{"type": "text", "text": "It is"}]},
        ]
    )
    messages = internal_messages(body.system, body.messages)
    assert messages[-1]["prefix"] is True and prefill_text(messages) == "It is"


def test_earlier_assistant_turns_and_tool_calls_are_not_prefills():
    call = {"type": "tool_use", "id": "t1", "name": "Read", "input": {"path": "a"}}
    body = request(
        messages=[
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": [call]},
        ]
    )
    messages = internal_messages(body.system, body.messages)
    assert not any(m.get("prefix") for m in messages) and prefill_text(messages) is None


def test_server_tools_stay_out_of_the_prompt():
    search = {"type": "web_search_20250305", "name": "web_search"}
    fields = prompt_fields(request(tools=[READ, search]))
    assert [t["function"]["name"] for t in fields["tools"]] == ["Read"]
    assert prompt_fields(request(tools=[search]))["tools"] is None
    with pytest.raises(InvalidRequest, match="web_search"):
        prompt_fields(request(tools=[search], tool_choice={"type": "tool", "name": "web_search"}))


@pytest.mark.parametrize("field", ["output_config", "output_format"])
def test_json_schema_output_becomes_the_response_format(field: str):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    spec = {"type": "json_schema", "schema": schema}
    value = {"format": spec, "effort": "low"} if field == "output_config" else spec
    assert request(**{field: value}).response_format() == {"type": "json_schema", "schema": schema}


@pytest.mark.parametrize(
    ("thinking", "shown"),
    [
        (None, True),
        ({"type": "enabled", "budget_tokens": 2048}, True),
        ({"type": "adaptive"}, True),
        ({"type": "disabled"}, False),
        ({"type": "adaptive", "display": "omitted"}, False),
        ({"type": "between_tools"}, True),
    ],
)
def test_thinking_says_whether_reasoning_is_shown(thinking: dict | None, shown: bool):
    assert request(thinking=thinking).shows_thinking() is shown


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (Overloaded("queue full"), 529, "overloaded_error"),
        (Unavailable("loading"), 529, "overloaded_error"),
        (ModelLoadError("broken"), 529, "overloaded_error"),
        (NotFound("nope"), 404, "not_found_error"),
        (InvalidRequest("bad"), 400, "invalid_request_error"),
    ],
)
def test_overload_is_529_overloaded_error(error: Exception, status: int, kind: str):
    assert anthropic_status(error) == status
    assert anthropic_error(error)["error"]["type"] == kind


def test_text_documents_are_read_as_text():
    document = {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": "Paris is in France."},
        "title": "Atlas",
        "cache_control": CACHE,
        "citations": {"enabled": True},
    }
    body = request(
        messages=[{"role": "user", "content": [document, {"type": "text", "text": "?"}]}]
    )
    (message,) = internal_messages(body.system, body.messages)
    assert message["content"][0] == {"type": "text", "text": "Atlas\nParis is in France."}


def test_pdf_documents_are_refused_with_a_reason():
    pdf = {
        "type": "document",
        "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"},
    }
    body = request(messages=[{"role": "user", "content": [pdf]}])
    with pytest.raises(InvalidRequest, match="PDF") as caught:
        internal_messages(body.system, body.messages)
    assert caught.value.param == "messages.0.content.0"
