"""Responses API pieces that need no model: input items → messages, parts → the event
sequence (checked against the `openai` SDK's own event types and stream accumulator), and the
on-disk store (owner scoping, TTL)."""

from __future__ import annotations

import asyncio
import json
import os
import time
import typing
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from mlxd.api.middleware.auth import owner_of
from mlxd.api.openai.responses.input import input_items, messages
from mlxd.api.openai.responses.protocol import ResponseCreateRequest
from mlxd.api.openai.responses.routes import initial_response, response_events
from mlxd.api.openai.responses.store import ResponseStore
from mlxd.config.stores import ResponseStoreConfig
from mlxd.errors import InvalidRequest, NotFound
from mlxd.parsers.base import ReasoningPart, TextPart, ToolCallArgs, ToolCallEnd, ToolCallStart
from mlxd.types import Finished, GenerationRequest


def _event_classes() -> dict[str, type]:
    """The SDK's event class for each event `type` (its stream union, unpacked)."""
    union = typing.get_args(ResponseStreamEvent)[0]
    return {
        typing.get_args(c.model_fields["type"].annotation)[0]: c for c in typing.get_args(union)
    }


EVENT_CLASSES = _event_classes()


def _validated(event: dict[str, Any]) -> Any:
    """`event` as the SDK's typed event, validated strictly (a missing field raises)."""
    return EVENT_CLASSES[event["type"]].model_validate(event)


async def _parts(*parts: Any) -> AsyncIterator[Any]:
    for part in parts:
        yield part


def _events(*parts: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(events with sequence numbers, responses passed to save) for `parts`."""
    body = ResponseCreateRequest(model="smol", input="hi")
    generation = GenerationRequest(request_id="r", model="smol", max_tokens=8)
    saved: list[dict[str, Any]] = []

    async def save(response: dict[str, Any]) -> None:
        saved.append(response)

    async def run() -> list[dict[str, Any]]:
        events = response_events(_parts(*parts), initial_response(body, generation, "resp_1"), save)
        return [{**e, "sequence_number": n} async for n, e in _numbered(events)]

    return asyncio.run(run()), saved


async def _numbered(events: AsyncIterator[dict]) -> AsyncIterator[tuple[int, dict]]:
    n = 0
    async for event in events:
        yield n, event
        n += 1


def test_every_event_is_a_valid_sdk_event_and_the_stream_helper_accepts_the_sequence():
    events, saved = _events(
        ReasoningPart("Let me "),
        ReasoningPart("think."),
        TextPart("Calling "),
        TextPart("tools."),
        ToolCallStart(0, "call_a", "get_weather"),
        ToolCallArgs(0, '{"city": '),
        ToolCallArgs(0, '"Paris"}'),
        ToolCallEnd(0),
        ToolCallStart(1, "call_b", "get_time"),
        ToolCallArgs(1, "{}"),
        ToolCallEnd(1),
        Finished("stop", prompt_tokens=10, completion_tokens=7),
    )
    state = ResponseStreamState(input_tools=[], text_format=openai_omit())
    for event in events:
        state.handle_event(_validated(event))  # raises on a wrong sequence
    final = state._completed_response
    assert final is not None and final.status == "completed"
    assert [item.type for item in final.output] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
    ]
    assert final.output[0].summary[0].text == "Let me think."
    assert final.output_text == "Calling tools."
    assert final.output[2].arguments == '{"city": "Paris"}' and final.output[3].call_id == "call_b"
    assert final.usage.total_tokens == 17
    assert saved == [events[-1]["response"]]
    Response.model_validate(saved[0])  # the non-streamed answer is a valid Response too


def test_a_length_finish_is_incomplete_with_its_reason():
    events, _ = _events(TextPart("Par"), Finished("length", prompt_tokens=5, completion_tokens=1))
    last = events[-1]
    assert last["type"] == "response.incomplete"
    response = Response.model_validate(last["response"])
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"


def openai_omit() -> Any:
    from openai import omit

    return omit


def test_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be terse."},
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "What is here?"},
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
            ],
        },
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A"}]},
        {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a cat"},
    ]
    result = messages(items, "Answer in French.")
    assert result[0] == {"role": "system", "content": "Answer in French."}
    assert result[1] == {"role": "system", "content": "Be terse."}
    assert result[2]["content"][1] == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64,AAAA"},
        "param": "input[1].content[1]",
    }
    # The call joins the assistant message that made it; its output is a tool message.
    assert result[3] == {
        "role": "assistant",
        "content": "A",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}
        ],
    }
    assert result[4] == {"role": "tool", "tool_call_id": "c1", "content": "a cat"}
    assert input_items("hi") == [{"type": "message", "role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ([{"type": "item_reference", "id": "x"}], "input[0].type"),
        ([{"role": "user", "content": [{"type": "input_file"}]}], "input[0].content[0]"),
        ([{"role": "user", "content": [{"type": "input_image"}]}], "input[0].content[0].image_url"),
        ([{"type": "function_call", "call_id": "c"}], "input[0]"),
        ([{"role": "assistant", "content": "only me"}], "input"),
    ],
)  # fmt: skip
def test_unusable_items_are_400s_naming_the_item(items: list, param: str):
    with pytest.raises(InvalidRequest) as caught:
        messages(items, None)
    assert caught.value.param == param


def test_the_store_keeps_responses_per_owner(tmp_path: Path):
    store = ResponseStore(tmp_path / "responses", ttl_s=60)
    alice, bob = owner_of("key-a"), owner_of("key-b")
    store.save(alice, {"id": "resp_ab12", "output": []}, [{"role": "user", "content": "hi"}], None)
    assert store.load(alice, "resp_ab12")["input"] == [{"role": "user", "content": "hi"}]
    path = tmp_path / "responses" / alice / "resp_ab12.json"
    assert "key-a" not in path.read_text()
    # Conversations: readable by the daemon's user only.
    assert (tmp_path / "responses").stat().st_mode & 0o777 == 0o700
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert path.stat().st_mode & 0o777 == 0o600
    for owner, response_id in [(bob, "resp_ab12"), (alice, "resp_ffff"), (alice, "../x")]:
        with pytest.raises(NotFound):
            store.load(owner, response_id)
    with pytest.raises(NotFound):
        store.delete(bob, "resp_ab12")
    store.delete(alice, "resp_ab12")
    with pytest.raises(NotFound):
        store.load(alice, "resp_ab12")


def _turn(store: ResponseStore, number: int, previous: str | None) -> str:
    response_id = f"resp_{number:02d}"
    output = [{"role": "assistant", "content": f"answer {number}"}]
    question = [{"role": "user", "content": f"question {number}"}]
    store.save("", {"id": response_id, "output": output}, question, previous)
    return response_id


def test_each_turn_stores_only_its_own_input(tmp_path: Path):
    store = ResponseStore(tmp_path, ttl_s=60)
    previous = None
    for number in range(1, 4):
        previous = _turn(store, number, previous)
    record = store.load("", "resp_03")
    assert record["input"] == [{"role": "user", "content": "question 3"}]
    assert record["previous"] == "resp_02"
    said = [item["content"] for item in store.conversation("", "resp_03")]
    assert said == [f"{kind} {n}" for n in (1, 2, 3) for kind in ("question", "answer")]
    assert [item["content"] for item in store.input_of("", "resp_03")] == said[:-1]
    store.delete("", "resp_01")  # a turn the conversation needs
    with pytest.raises(NotFound, match="resp_01"):
        store.conversation("", "resp_03")


def test_expired_responses_are_gone_and_pruned(tmp_path: Path):
    store = ResponseStore(tmp_path, ttl_s=60)
    _turn(store, 1, None)
    old = time.time() - 120
    os.utime(tmp_path / "open" / "resp_01.json", (old, old))
    with pytest.raises(NotFound):
        store.load("", "resp_01")
    _turn(store, 2, None)
    store.prune()
    assert sorted(p.name for p in (tmp_path / "open").iterdir()) == ["resp_02.json"]


def test_continuing_a_turn_renews_the_turns_before_it(tmp_path: Path):
    store = ResponseStore(tmp_path, ttl_s=60)
    _turn(store, 1, None)
    aging = time.time() - 50
    os.utime(tmp_path / "open" / "resp_01.json", (aging, aging))
    _turn(store, 2, "resp_01")
    assert time.time() - (tmp_path / "open" / "resp_01.json").stat().st_mtime < 10


def test_a_flat_file_of_an_older_mlxd_moves_to_its_owners_folder(tmp_path: Path):
    record = {"owner": owner_of("k"), "response": {"id": "resp_0a", "output": []}, "input": []}
    (tmp_path / "resp_0a.json").write_text(json.dumps(record))
    store = ResponseStore(tmp_path, ttl_s=60)
    store.prune()
    assert store.load(owner_of("k"), "resp_0a")["input"] == []
    assert store.input_of(owner_of("k"), "resp_0a") == []
    assert not (tmp_path / "resp_0a.json").exists()


def test_the_quota_counts_what_one_owner_keeps(tmp_path: Path):
    store = ResponseStore(tmp_path, ttl_s=60)
    quota = ResponseStoreConfig(max_responses=2, max_bytes=10**6)
    _turn(store, 1, None)
    store.admit("", quota)
    _turn(store, 2, None)
    with pytest.raises(InvalidRequest, match="max_responses") as caught:
        store.admit("", quota)
    assert caught.value.param == "store"
    store.admit(owner_of("other"), quota)  # each key has its own
    store.save(owner_of("other"), {"id": "resp_0f", "output": []}, [], None)
    with pytest.raises(InvalidRequest):  # an open daemon's callers share one
        store.admit(None, ResponseStoreConfig(max_responses=3, max_bytes=10**6))
    with pytest.raises(InvalidRequest, match="max_bytes"):
        store.admit("", ResponseStoreConfig(max_responses=10, max_bytes=100))
