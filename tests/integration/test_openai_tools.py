"""Tools and structured output through the official openai SDK, on the real SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string"}},
            "required": ["timezone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir)},
        "models": {
            "smol": {
                "source": SMOL_GGUF,
                "context_length": 1024,
                "defaults": {"max_tokens": 64, "temperature": 0.0},
            }
        },
    }
    running = start_daemon(tmp_path_factory.mktemp("tools"), config)
    yield running
    running.stop()


@pytest.fixture
def client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="x", max_retries=0)


def test_json_schema_output_validates(client: openai.OpenAI):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "population": {"type": "integer"},
            "continent": {"enum": ["Europe", "Asia", "Africa"]},
        },
        "required": ["city", "population", "continent"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": schema, "strict": True},
        },
        max_tokens=80,
    )
    data = json.loads(reply.choices[0].message.content)
    assert set(data) == {"city", "population", "continent"}
    assert isinstance(data["city"], str) and isinstance(data["population"], int)
    assert data["continent"] in ("Europe", "Asia", "Africa")


def test_json_object_output_parses(client: openai.OpenAI):
    reply = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Reply with a JSON object saying hello."}],
        response_format={"type": "json_object"},
        max_tokens=200,
    )
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_forced_tool_call_parses(client: openai.OpenAI):
    reply = client.chat.completions.create(
        model="smol", messages=ASK, tools=[WEATHER, TIME], tool_choice="required"
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments), dict)


def test_named_tool_choice_calls_that_tool(client: openai.OpenAI):
    reply = client.chat.completions.create(
        model="smol",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time"
    assert isinstance(json.loads(call.function.arguments)["timezone"], str)


def test_streamed_tool_call_reassembles_to_the_non_streamed_one(client: openai.OpenAI):
    kwargs = {
        "model": "smol",
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            if delta.function.name:
                call["name"] += delta.function.name
            call["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert len(calls) == 1
    expected = whole.message.tool_calls[0]
    assert calls[0]["name"] == expected.function.name
    assert json.loads(calls[0]["arguments"]) == json.loads(expected.function.arguments)


def test_tool_round_trip(client: openai.OpenAI):
    first = client.chat.completions.create(
        model="smol", messages=ASK, tools=[WEATHER], tool_choice="required"
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    answer = client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER])
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
    ],
)
def test_bad_tool_requests_are_400(client: openai.OpenAI, kwargs: dict, param: str):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="smol", messages=ASK, **kwargs)
    assert caught.value.body["param"] == param
