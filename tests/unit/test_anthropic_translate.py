"""Anthropic Messages ↔ mlxd's internal form: requests in, content-block events out."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import ValidationError

from mlxd.api.anthropic.messages import (
    ContentBlocks,
    _keep_alive,
    fold,
    message_delta,
    message_events,
)
from mlxd.api.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    internal_messages,
    prompt_fields,
)
from mlxd.errors import InvalidRequest
from mlxd.parsers.base import ReasoningPart, TextPart, ToolCallArgs, ToolCallEnd, ToolCallStart
from mlxd.types import Finished

WEATHER = {
    "name": "weather",
    "description": "Current weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def request(**fields: Any) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return MessagesRequest.model_validate({**body, **fields})


def translate(messages: list[dict[str, Any]], system: Any = None) -> list[dict[str, Any]]:
    body = request(messages=messages, system=system)
    return internal_messages(body.system, body.messages)


# --- requests -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("system", "expected"),
    [
        ("Be brief.", [{"role": "system", "content": "Be brief."}]),
        (
            [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
            [{"role": "system", "content": "Be brief.\nBe kind."}],
        ),
        ("", []),
        (None, []),
    ],
)
def test_system_leads_as_one_message(system: Any, expected: list[dict]):
    assert translate([{"role": "user", "content": "hi"}], system) == [
        *expected,
        {"role": "user", "content": "hi"},
    ]


def test_string_turns_pass_through():
    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert translate(turns) == turns


def test_text_and_image_blocks_become_openai_image_parts():
    png = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
    url = {"type": "url", "url": "https://example.com/cat.jpg"}
    blocks = [
        {"type": "text", "text": "Compare", "cache_control": {"type": "ephemeral"}},
        {"type": "image", "source": png},
        {"type": "image", "source": url},
    ]
    assert translate([{"role": "user", "content": blocks}]) == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                {
                    "type": "image_url",
                    "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="},
                    "param": "messages[0].content[1]",
                },
                {
                    "type": "image_url",
                    "image_url": {"url": "https://example.com/cat.jpg"},
                    "param": "messages[0].content[2]",
                },
            ],
        }
    ]


def test_tool_round_trip():
    turns = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Two cities.", "signature": "sig"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "t2", "name": "weather", "input": {"city": "Rome"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "18°C"},
                {
                    "type": "tool_result",
                    "tool_use_id": "t2",
                    "content": [{"type": "text", "text": "no"}, {"type": "text", "text": "data"}],
                    "is_error": True,
                },
                {"type": "text", "text": "Summarise."},
            ],
        },
    ]
    calls = [
        {
            "id": tool_id,
            "type": "function",
            "function": {"name": "weather", "arguments": json.dumps({"city": city})},
        }
        for tool_id, city in [("t1", "Paris"), ("t2", "Rome")]
    ]
    assert translate(turns) == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Checking."}],
            "tool_calls": calls,
        },
        {"role": "tool", "tool_call_id": "t1", "content": "18°C"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: no\ndata"},
        {"role": "user", "content": [{"type": "text", "text": "Summarise."}]},
    ]


def test_tool_result_keeps_its_place_among_user_blocks():
    blocks = [
        {"type": "text", "text": "Before"},
        {"type": "tool_result", "tool_use_id": "t1"},
        {"type": "text", "text": "After"},
    ]
    assert translate([{"role": "user", "content": blocks}]) == [
        {"role": "user", "content": [{"type": "text", "text": "Before"}]},
        {"role": "tool", "tool_call_id": "t1", "content": ""},
        {"role": "user", "content": [{"type": "text", "text": "After"}]},
    ]


@pytest.mark.parametrize(
    ("role", "block"),
    [
        ("user", {"type": "tool_use", "id": "t1", "name": "weather", "input": {}}),
        ("assistant", {"type": "tool_result", "tool_use_id": "t1", "content": "x"}),
        ("assistant", {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}),
    ],
)
def test_blocks_in_the_wrong_turn_are_rejected(role: str, block: dict):
    with pytest.raises(InvalidRequest, match=block["type"]):
        translate([{"role": role, "content": [block]}])


def test_tools_and_choices():
    fields = prompt_fields(request(tools=[WEATHER, {"name": "now", "input_schema": {}}]))
    assert fields["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "parameters": WEATHER["input_schema"],
                "description": "Current weather",
            },
        },
        {"type": "function", "function": {"name": "now", "parameters": {}}},
    ]
    assert fields["tool_choice"] is None and fields["parallel_tool_calls"] is True


@pytest.mark.parametrize(
    ("choice", "internal", "parallel"),
    [
        ({"type": "auto"}, "auto", True),
        ({"type": "any"}, "required", True),
        (
            {"type": "tool", "name": "weather", "disable_parallel_tool_use": True},
            {"name": "weather"},
            False,
        ),
        ({"type": "none"}, "none", True),
    ],
)
def test_tool_choice(choice: dict, internal: Any, parallel: bool):
    fields = prompt_fields(request(tools=[WEATHER], tool_choice=choice))
    assert fields["tool_choice"] == internal
    assert fields["parallel_tool_calls"] is parallel
    # "none" keeps the tools out of the prompt, so nothing can be called.
    assert (fields["tools"] is None) == (internal == "none")


@pytest.mark.parametrize(
    ("tools", "choice", "needle"),
    [
        ([WEATHER], {"type": "tool", "name": "clock"}, "clock"),
        (None, {"type": "any"}, "needs tools"),
    ],
)
def test_tool_choice_must_match_tools(tools: Any, choice: dict, needle: str):
    with pytest.raises(InvalidRequest, match=needle):
        prompt_fields(request(tools=tools, tool_choice=choice))


@pytest.mark.parametrize(
    ("fields", "loc"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
        ({"thinking": {"type": "enabled"}}, "budget_tokens"),
        ({"output_config": {"effort": "extreme"}}, "effort"),
        ({"output_config": {"format": {"type": "json_schema"}}}, "schema"),
        ({"tools": [{"name": "f"}]}, "input_schema"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "type"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice"),
    ],
)
def test_invalid_requests(fields: dict, loc: str):
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    body = {k: v for k, v in {**body, **fields}.items() if v is not None}
    with pytest.raises(ValidationError, match=loc):
        MessagesRequest.model_validate(body)


def test_compatibility_fields_are_accepted():
    body = request(
        thinking={"type": "enabled", "budget_tokens": 1024},
        metadata={"user_id": "u"},
        stop_sequences=["\n\n"],
        top_k=5,
        service_tier="auto",
    )
    assert body.stop_sequences == ["\n\n"] and body.top_k == 5


def test_count_tokens_needs_no_max_tokens():
    body = CountTokensRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    )
    assert prompt_fields(body)["tools"][0]["function"]["name"] == "weather"


# --- responses ------------------------------------------------------------------------------


async def _events(parts: list[Any]) -> list[dict[str, Any]]:
    async def source() -> AsyncIterator[Any]:
        for part in parts:
            yield part

    return [event async for event in message_events(source())]


def _run(parts: list[Any]) -> list[dict[str, Any]]:
    return asyncio.run(_events(parts))


STOP = Finished("stop", prompt_tokens=7, completion_tokens=5)


def test_text_is_one_block():
    events = _run([TextPart("Par"), TextPart(""), TextPart("is"), STOP])
    assert [e["type"] for e in events] == [
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
    ]
    assert events[0]["content_block"] == {"type": "text", "text": ""}
    assert fold(events[:-1]) == [{"type": "text", "text": "Paris"}]
    assert events[-1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"input_tokens": 7, "output_tokens": 5},
    }


def test_thinking_text_and_tool_calls_are_blocks_in_order():
    parts = [
        ReasoningPart("Need "),
        ReasoningPart("weather."),
        TextPart("Checking."),
        ToolCallStart(0, "call_a", "weather"),
        ToolCallArgs(0, '{"city": '),
        ToolCallArgs(0, '"Paris"}'),
        ToolCallEnd(0),
        ToolCallStart(1, "call_b", "weather"),
        ToolCallArgs(1, '{"city": "Rome"}'),
        ToolCallEnd(1),
        STOP,
    ]
    events = _run(parts)
    starts = [e for e in events if e["type"] == "content_block_start"]
    stops = [e for e in events if e["type"] == "content_block_stop"]
    assert [e["index"] for e in starts] == [0, 1, 2, 3] == [e["index"] for e in stops]
    assert starts[2]["content_block"] == {
        "type": "tool_use",
        "id": "call_a",
        "name": "weather",
        "input": {},
    }
    json_deltas = [e["delta"] for e in events if e.get("index") == 2 and "delta" in e]
    assert json_deltas == [
        {"type": "input_json_delta", "partial_json": '{"city": '},
        {"type": "input_json_delta", "partial_json": '"Paris"}'},
    ]
    assert fold(events[:-1]) == [
        {"type": "thinking", "thinking": "Need weather.", "signature": ""},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_a", "name": "weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_b", "name": "weather", "input": {"city": "Rome"}},
    ]
    assert events[-1]["delta"]["stop_reason"] == "tool_use"


def test_empty_answer_has_no_blocks():
    assert _run([STOP]) == [message_delta(STOP, called_tools=False)]


def test_blocks_are_not_reopened_for_one_kind():
    blocks = ContentBlocks()
    events = [*blocks.feed(TextPart("a")), *blocks.feed(TextPart("b")), *blocks.close()]
    assert [e["type"] for e in events].count("content_block_start") == 1
    assert blocks.close() == []


@pytest.mark.parametrize(
    ("finished", "called", "reason", "sequence"),
    [
        (Finished("stop", 1, 2), False, "end_turn", None),
        (Finished("stop", 1, 2, stop_string="\n\n"), False, "stop_sequence", "\n\n"),
        (Finished("length", 1, 2), False, "max_tokens", None),
        (Finished("length", 1, 2), True, "max_tokens", None),
        (Finished("stop", 1, 2), True, "tool_use", None),
    ],
)
def test_stop_reasons(finished: Finished, called: bool, reason: str, sequence: str | None):
    delta = message_delta(finished, called)["delta"]
    assert delta == {"stop_reason": reason, "stop_sequence": sequence}


def test_keep_alive_pings_while_waiting_and_loses_nothing():
    async def slow() -> AsyncIterator[bytes]:
        yield b"a"
        await asyncio.sleep(0.25)
        yield b"b"

    async def main() -> list[bytes]:
        return [chunk async for chunk in _keep_alive(slow(), interval=0.05)]

    chunks = asyncio.run(main())
    assert chunks[0] == b"a" and chunks[-1] == b"b"
    pings = chunks[1:-1]
    assert len(pings) >= 3
    assert set(pings) == {b'event: ping\ndata: {"type":"ping"}\n\n'}


def test_keep_alive_closed_early_cancels_the_source():
    cancelled = asyncio.Event()

    async def endless() -> AsyncIterator[bytes]:
        yield b"a"
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.set()
        yield b"never"

    async def main() -> None:
        stream = _keep_alive(endless(), interval=0.05)
        assert await anext(stream) == b"a"
        assert b"ping" in await anext(stream)  # the source is now waiting, in its task
        await stream.aclose()
        assert cancelled.is_set()

    asyncio.run(main())
