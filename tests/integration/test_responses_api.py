"""The OpenAI Responses API through the official `openai` SDK, against the real daemon and
the real SmolLM2: create, stream, tools through previous_response_id, structured output,
stored responses (retrieve, delete, store false, key scoping, a restart)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

KEY_A, KEY_B = "key-a-responses", "key-b-responses"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
    "strict": True,
}
FRANCE = "What is the capital of France?"


def config(cache_dir: Path) -> dict:
    return {
        "server": {"cache_dir": str(cache_dir), "api_keys": [KEY_A, KEY_B]},
        "models": {
            "smol": {
                "source": SMOL_GGUF,
                "context_length": 1024,
                "defaults": {"max_tokens": 48, "temperature": 0.0},
            },
            # The same weights read with the `<think>` reasoning parser (loaded on first use).
            "thinker": {
                "source": SMOL_GGUF,
                "load": "lazy",
                "context_length": 1024,
                "parsers": {"reasoning": "think"},
                "defaults": {"max_tokens": 48, "temperature": 0.0},
            },
        },
    }


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    running = start_daemon(tmp_path_factory.mktemp("responses"), config(mlxd_cache_dir))
    yield running
    running.stop()


def sdk(daemon: Daemon, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key=key, max_retries=0)


@pytest.fixture
def client(daemon: Daemon) -> openai.OpenAI:
    return sdk(daemon)


def test_string_input(client: openai.OpenAI):
    reply = client.responses.create(model="smol", input=FRANCE)
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.status == "completed" and reply.incomplete_details is None
    assert reply.output[0].type == "message" and reply.output[0].role == "assistant"
    assert "Paris" in reply.output_text
    usage = reply.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_item_list_and_instructions_reach_the_model(client: openai.OpenAI):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "My name is Zoltan."}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Nice to meet you, Zoltan."}],
        },
        {"role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]},
    ]
    reply = client.responses.create(model="smol", input=items)
    assert "Zoltan" in reply.output_text
    short = client.responses.create(
        model="smol", input="Say hello.", instructions="Be brief.", max_output_tokens=4
    )
    pirate = "You are a pirate captain sailing the seven seas. " * 4
    long = client.responses.create(
        model="smol", input="Say hello.", instructions=pirate, max_output_tokens=4
    )
    assert long.instructions == pirate
    # The instructions are the system prompt the model read (the template's default one is
    # replaced, so only the difference between two instructions says so).
    assert long.usage.input_tokens > short.usage.input_tokens + 20


def test_stream_deltas_reassemble_and_the_sdk_helper_accepts_the_sequence(
    client: openai.OpenAI,
):
    deltas, kinds, numbers = [], [], []
    with client.responses.stream(model="smol", input=FRANCE) as stream:
        for event in stream:
            kinds.append(event.type)
            numbers.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert numbers == list(range(len(numbers)))
    assert len(deltas) > 1 and "".join(deltas) == final.output_text
    assert "Paris" in final.output_text and final.usage.output_tokens > 0
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_a_stream_the_client_drops_is_cancelled(daemon: Daemon):
    auth = {"Authorization": f"Bearer {KEY_A}"}

    def cancelled() -> int:
        status = httpx.get(f"{daemon.url}/v1/status", headers=auth, timeout=10).json()
        return status["models"]["smol"]["cancelled"]

    before = cancelled()
    body = {"model": "smol", "input": "Tell me a very long story.", "stream": True}
    body |= {"max_output_tokens": 400, "temperature": 0.7}
    with (
        httpx.Client(timeout=30, headers=auth) as http,
        http.stream("POST", f"{daemon.url}/v1/responses", json=body) as response,
    ):
        deltas = (line for line in response.iter_lines() if "output_text.delta" in line)
        assert next(deltas) and next(deltas)
    deadline = time.monotonic() + 30  # a generous bound: this only waits for the cancel
    while cancelled() == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cancelled() == before + 1


def test_reasoning_comes_out_as_a_reasoning_item(client: openai.OpenAI):
    # SmolLM2 does not reason by itself: a schema makes it write a think block (as a JSON
    # string, hence the quotes around it), which the model's reasoning parser reads.
    schema = {"type": "string", "pattern": "^<think>[a-z ]{3,30}</think>[A-Za-z ]{3,30}$"}
    text_format = {"format": {"type": "json_schema", "name": "thought", "schema": schema}}
    summary = []
    with client.responses.stream(
        model="thinker", input="Think about Paris, then name it.", text=text_format
    ) as stream:
        for event in stream:
            if event.type == "response.reasoning_summary_text.delta":
                summary.append(event.delta)
        final = stream.get_final_response()
    reasoning = [item for item in final.output if item.type == "reasoning"]
    assert len(reasoning) == 1 and reasoning[0].summary[0].type == "summary_text"
    assert reasoning[0].summary[0].text == "".join(summary) and summary
    assert "<think>" not in final.output_text and "</think>" not in final.output_text
    whole = client.responses.create(model="thinker", input="Think about Paris.", text=text_format)
    assert [item.type for item in whole.output].count("reasoning") == 1


def test_max_output_tokens_makes_an_incomplete_response(client: openai.OpenAI):
    reply = client.responses.create(model="smol", input=FRANCE, max_output_tokens=3)
    assert reply.status == "incomplete"
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 3 and reply.output[0].status == "incomplete"


def test_function_call_round_trip_through_previous_response_id(client: openai.OpenAI):
    # A hosted tool that clients offer by default is accepted, and not shown to the model.
    tools = [WEATHER, {"type": "web_search"}]
    first = client.responses.create(
        model="smol", input="What is the weather in Paris?", tools=tools, tool_choice="required"
    )
    assert [tool.type for tool in first.tools] == ["function", "web_search"]
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather", first.output
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18C, sunny"}
    second = client.responses.create(
        model="smol", previous_response_id=first.id, input=[result], tools=[WEATHER]
    )
    assert second.status == "completed" and second.previous_response_id == first.id
    assert second.output_text or any(i.type == "function_call" for i in second.output)
    # The stored turn (question and call) was prepended to the new input.
    assert second.usage.input_tokens > first.usage.input_tokens


def test_streamed_function_call_arguments_reassemble(client: openai.OpenAI):
    fragments = []
    with client.responses.stream(
        model="smol",
        input="What is the weather in Rome?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        store=False,
    ) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                fragments.append(event.delta)
        final = stream.get_final_response()
    call = final.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert "".join(fragments) == call.arguments
    assert isinstance(json.loads(call.arguments)["city"], str)


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
    reply = client.responses.create(
        model="smol",
        input="Describe Paris as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
        max_output_tokens=80,
    )
    assert reply.status == "completed", reply.output_text
    data = json.loads(reply.output_text)
    assert set(data) == {"city", "population", "continent"}
    assert isinstance(data["city"], str) and isinstance(data["population"], int)
    assert data["continent"] in ("Europe", "Asia", "Africa")
    assert reply.text.format.type == "json_schema"


def test_retrieve_then_delete(client: openai.OpenAI):
    reply = client.responses.create(model="smol", input=FRANCE, max_output_tokens=8)
    stored = client.responses.retrieve(reply.id)
    assert stored.id == reply.id and stored.output_text == reply.output_text
    client.responses.delete(reply.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(reply.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(reply.id)


def test_input_items_list_what_the_model_read(client: openai.OpenAI):
    first = client.responses.create(model="smol", input="Hi, I am Ada.", max_output_tokens=4)
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]},
    ]
    second = client.responses.create(
        model="smol", input=items, previous_response_id=first.id, max_output_tokens=4
    )
    listed = client.responses.input_items.list(second.id, order="asc")
    assert [item.type for item in listed.data] == ["message", "message", "message"]
    assert listed.data[0].content[0].text == "Hi, I am Ada."
    assert listed.data[1].id == first.output[0].id  # the earlier answer, as it was stored
    assert listed.data[2].content[0].text == "What is my name?"
    newest = client.responses.input_items.list(second.id, limit=1)
    assert [item.id for item in newest.data] == [listed.data[2].id] and newest.has_more
    rest = client.responses.input_items.list(second.id, limit=5, after=newest.data[0].id)
    assert [item.id for item in rest.data] == [listed.data[1].id, listed.data[0].id]
    assert [i.id for i in client.responses.input_items.list(second.id, order="asc").data] == [
        i.id for i in listed.data
    ]


def test_store_false_is_not_kept(client: openai.OpenAI):
    reply = client.responses.create(model="smol", input=FRANCE, max_output_tokens=4, store=False)
    assert reply.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(reply.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="smol", input="And?", previous_response_id=reply.id)


def test_another_key_sees_nothing(daemon: Daemon, client: openai.OpenAI):
    reply = client.responses.create(model="smol", input=FRANCE, max_output_tokens=4)
    other = sdk(daemon, KEY_B)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(reply.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(reply.id)
    with pytest.raises(openai.NotFoundError) as caught:
        other.responses.create(model="smol", input="And?", previous_response_id=reply.id)
    assert caught.value.body["param"] == "previous_response_id"
    assert client.responses.retrieve(reply.id).id == reply.id  # untouched for its owner
    no_key = httpx.get(f"{daemon.url}/v1/responses/{reply.id}", timeout=10)
    assert no_key.status_code == 401


def test_a_codex_shaped_request_streams_to_completion(daemon: Daemon):
    """A request shaped as Codex CLI sends them (composed from its request types, not a
    capture): developer and environment messages, a replayed reasoning item, a shell call and
    its output, function tools plus a hosted one, and fields mlxd does not act on."""
    body = json.loads((Path(__file__).parent / "fixtures" / "codex_request.json").read_text())
    headers = {"Authorization": f"Bearer {KEY_A}"}
    with httpx.stream(
        "POST", f"{daemon.url}/v1/responses", json=body, headers=headers, timeout=120
    ) as response:
        assert response.status_code == 200, response.read()
        events = [json.loads(line[6:]) for line in response.iter_lines() if line[:6] == "data: "]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]
    assert final["type"] in ("response.completed", "response.incomplete"), final
    assert final["response"]["output"] and final["response"]["usage"]["input_tokens"] > 200
    assert final["response"]["store"] is False


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": "hi", "temperature": 3}, "temperature"),
        ({"input": "hi", "tools": [{"type": "function"}]}, "tools.0.function.name"),
        (
            {"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}},
            "tool_choice",
        ),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"input": "hi", "previous_response_id": "resp_0"}, "previous_response_id"),
    ],
)
def test_bad_requests_are_openai_shaped_errors(daemon: Daemon, body: dict, param: str):
    reply = httpx.post(
        f"{daemon.url}/v1/responses",
        json={"model": "smol", **body},
        headers={"Authorization": f"Bearer {KEY_A}"},
        timeout=30,
    )
    assert reply.status_code in (400, 404), reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_stored_responses_survive_a_restart(
    daemon: Daemon, tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path
):
    reply = sdk(daemon).responses.create(model="smol", input=FRANCE, max_output_tokens=8)
    daemon.stop()
    again = start_daemon(tmp_path_factory.mktemp("responses-again"), config(mlxd_cache_dir))
    try:
        assert sdk(again).responses.retrieve(reply.id).output_text == reply.output_text
        with pytest.raises(openai.NotFoundError):
            sdk(again, KEY_B).responses.retrieve(reply.id)
    finally:
        again.stop()
