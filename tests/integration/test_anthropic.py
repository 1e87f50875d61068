"""The Anthropic Messages API end to end: the real daemon, SmolLM2, the official SDK."""

from __future__ import annotations

import json
import time
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
COLOURS = [{"role": "user", "content": "Name three colours."}]
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    workdir = tmp_path_factory.mktemp("anthropic-api")
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir)},
        "models": {
            "smol": {
                "source": SMOL_GGUF,
                "aliases": ["claude-local"],
                "context_length": 512,
                "defaults": {"temperature": 0.0},
            },
        },
    }
    running = start_daemon(workdir, config)
    yield running
    running.stop()


@pytest.fixture
def client(daemon: Daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daemon.url, api_key="x", max_retries=0)


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_france_answers_paris(client: anthropic.Anthropic):
    # SDK 2.x dropped the sampling parameters from create(); clients send them as extra_body.
    sampling = {"temperature": 0, "top_p": 0.9, "top_k": 40}
    reply = client.messages.create(
        model="smol", max_tokens=32, messages=FRANCE, extra_body=sampling
    )
    assert reply.id.startswith("msg_") and reply.role == "assistant" and reply.model == "smol"
    assert [block.type for block in reply.content] == ["text"]
    assert "Paris" in text_of(reply)
    assert reply.stop_reason == "end_turn" and reply.stop_sequence is None
    assert reply.usage.input_tokens > 5 and reply.usage.output_tokens > 0


def test_alias_is_echoed(client: anthropic.Anthropic):
    reply = client.messages.create(model="claude-local", max_tokens=8, messages=FRANCE)
    assert reply.model == "claude-local"


def test_system_as_string_and_as_blocks(client: anthropic.Anthropic):
    pirate = "You are a pirate. Answer like one."
    plain = client.messages.count_tokens(model="smol", messages=FRANCE).input_tokens
    as_string = client.messages.create(model="smol", max_tokens=16, system=pirate, messages=FRANCE)
    as_blocks = client.messages.create(
        model="smol",
        max_tokens=16,
        system=[{"type": "text", "text": pirate}],
        messages=FRANCE,
    )
    assert as_string.usage.input_tokens == as_blocks.usage.input_tokens != plain
    assert text_of(as_string) == text_of(as_blocks) != ""


def test_multi_turn(client: anthropic.Anthropic):
    turns = [
        *FRANCE,
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": [{"type": "text", "text": "And what is its population?"}]},
    ]
    first = client.messages.create(model="smol", max_tokens=8, messages=FRANCE)
    reply = client.messages.create(model="smol", max_tokens=16, messages=turns)
    assert reply.usage.input_tokens > first.usage.input_tokens + 10
    assert text_of(reply)


def test_max_tokens(client: anthropic.Anthropic):
    reply = client.messages.create(model="smol", max_tokens=3, messages=FRANCE)
    assert reply.stop_reason == "max_tokens"
    assert reply.usage.output_tokens == 3


def test_stop_sequence_is_reported(client: anthropic.Anthropic):
    reply = client.messages.create(
        model="smol", max_tokens=32, messages=FRANCE, stop_sequences=["Paris", "Zanzibar"]
    )
    assert reply.stop_reason == "stop_sequence"
    assert reply.stop_sequence == "Paris"
    assert "Paris" not in text_of(reply)


def test_stream_text_matches_the_non_streamed_answer(client: anthropic.Anthropic):
    kwargs = {"model": "smol", "max_tokens": 24, "messages": COLOURS}
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(whole)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_raw_event_sequence(daemon: Daemon):
    body = {"model": "smol", "max_tokens": 5, "messages": COLOURS, "stream": True}
    headers = {"x-api-key": "x", "anthropic-version": "2023-06-01"}
    events = []
    with httpx.stream(
        "POST", f"{daemon.url}/v1/messages", json=body, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for frame in response.read().decode().split("\n\n"):
            if frame:
                name, data = frame.split("\n")
                payload = json.loads(data.removeprefix("data: "))
                assert name == f"event: {payload['type']}"
                events.append(payload)
    kinds = [e["type"] for e in events if e["type"] != "ping"]
    deltas = kinds.count("content_block_delta")
    assert deltas >= 1
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] > 5
    end = next(e for e in events if e["type"] == "message_delta")
    assert end["delta"]["stop_reason"] == "max_tokens"
    assert end["usage"]["output_tokens"] == 5


def test_aborted_stream_frees_its_slot(daemon: Daemon):
    cancelled_before = daemon.status()["models"]["smol"]["cancelled"]
    body = {
        "model": "smol",
        "max_tokens": 300,
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "stream": True,
    }
    with httpx.stream("POST", f"{daemon.url}/v1/messages", json=body, timeout=30) as response:
        deltas = (line for line in response.iter_lines() if "content_block_delta" in line)
        next(deltas), next(deltas)
    stats = daemon.wait_for_cancel("smol", cancelled_before)
    assert stats["running"] == 0 and stats["cancelled"] == cancelled_before + 1


def test_count_tokens(client: anthropic.Anthropic):
    short = client.messages.count_tokens(model="smol", messages=FRANCE).input_tokens
    longer = client.messages.count_tokens(
        model="smol",
        messages=[{"role": "user", "content": "What is the capital of France, and of Spain?"}],
    ).input_tokens
    assert 5 < short < longer
    reply = client.messages.create(model="smol", max_tokens=4, messages=FRANCE)
    assert reply.usage.input_tokens == short


def test_count_tokens_includes_tools(client: anthropic.Anthropic):
    plain = client.messages.count_tokens(model="smol", messages=FRANCE).input_tokens
    with_tools = client.messages.count_tokens(model="smol", messages=FRANCE, tools=[WEATHER])
    assert with_tools.input_tokens > plain + 20


def test_tool_result_turn_is_answered(client: anthropic.Anthropic):
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18°C and sunny"}
    turns = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result]},
    ]
    counted = client.messages.count_tokens(model="smol", messages=turns, tools=[WEATHER])
    reply = client.messages.create(model="smol", max_tokens=16, messages=turns, tools=[WEATHER])
    assert reply.usage.input_tokens == counted.input_tokens
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use") and reply.content


def test_forced_tool_call_round_trip(client: anthropic.Anthropic):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    kwargs = {"model": "smol", "max_tokens": 64, "tools": [WEATHER], "tool_choice": choice}
    reply = client.messages.create(messages=ask, **kwargs)
    assert reply.stop_reason == "tool_use"
    [call] = [block for block in reply.content if block.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input["city"], str)

    with client.messages.stream(messages=ask, **kwargs) as stream:
        deltas = [event.delta.type for event in stream if event.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert set(deltas) == {"input_json_delta"}
    [streamed_call] = [block for block in streamed.content if block.type == "tool_use"]
    assert (streamed_call.name, streamed_call.input) == (call.name, call.input)

    turns = [
        *ask,
        reply.to_param(),
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18°C, sunny"}],
        },
    ]
    answer = client.messages.create(model="smol", max_tokens=24, messages=turns, tools=[WEATHER])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content


def test_missing_max_tokens_is_invalid_request(daemon: Daemon):
    client = anthropic.Anthropic(base_url=daemon.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as caught:
        # The SDK insists on max_tokens; extra_body cannot remove it, so go around it.
        client.post(
            "/v1/messages",
            body={"model": "smol", "messages": FRANCE},
            cast_to=httpx.Response,
        )
    assert caught.value.status_code == 400
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in caught.value.message


def test_unknown_model_is_not_found(client: anthropic.Anthropic):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-opus-9", max_tokens=4, messages=FRANCE)
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": caught.value.body["error"]["message"]},
        "request_id": caught.value.request_id,  # as the real API sends it
    }
    assert "smol" in caught.value.body["error"]["message"]


def test_image_to_a_text_model_is_rejected(client: anthropic.Anthropic):
    content = [{"type": "image", "source": PNG}, {"type": "text", "text": "What is this?"}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model="smol", max_tokens=4, messages=[{"role": "user", "content": content}]
        )
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in caught.value.body["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body", "status", "kind", "needle"),
    [
        ("/v1/messages", b"{not json", 400, "invalid_request_error", "not valid JSON"),
        ("/v1/messages/count_tokens", b"{not json", 400, "invalid_request_error", "JSON"),
        (
            "/v1/messages",
            b'{"model": "smol", "max_tokens": 4, "messages": [{"role": "tool", "content": "hi"}]}',
            400,
            "invalid_request_error",
            "role",
        ),
        (
            "/v1/messages",
            b'{"model": "smol", "max_tokens": 4, "temperature": 1.5, '
            b'"messages": [{"role": "user", "content": "hi"}]}',
            400,
            "invalid_request_error",
            "temperature",
        ),
        (
            "/v1/messages",
            b'{"model": "smol", "max_tokens": 4, "tool_choice": {"type": "tool", "name": "f"}, '
            b'"messages": [{"role": "user", "content": "hi"}]}',
            400,
            "invalid_request_error",
            "tool_choice",
        ),
        (
            "/v1/messages/count_tokens",
            b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}',
            404,
            "not_found_error",
            "smol",
        ),
        ("/v1/messages/nothing", b"{}", 404, "not_found_error", "no route"),
    ],
)
def test_errors_have_anthropic_shape(
    daemon: Daemon, path: str, body: bytes, status: int, kind: str, needle: str
):
    response = httpx.post(
        f"{daemon.url}{path}",
        content=body,
        headers={"content-type": "application/json", "x-api-key": "x"},
        timeout=30,
    )
    assert response.status_code == status, response.text
    payload = response.json()
    assert payload["type"] == "error" and payload["error"]["type"] == kind
    assert needle in payload["error"]["message"]


def test_oversized_prompt_is_invalid_request(client: anthropic.Anthropic):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model="smol", max_tokens=4, messages=[{"role": "user", "content": "word " * 600}]
        )
    assert "context" in caught.value.message


def test_openai_routes_keep_their_error_shape(daemon: Daemon):
    response = httpx.post(f"{daemon.url}/v1/chat/completions", content=b"{not json", timeout=30)
    assert response.status_code == 400
    assert "type" not in response.json() and response.json()["error"]["type"]


def test_message_batch_of_three_runs_to_completion(client: anthropic.Anthropic):
    questions = ["What is the capital of France?", "Name a colour.", "Say hi."]
    batch = client.messages.batches.create(
        requests=[
            {
                "custom_id": f"q{i}",
                "params": {
                    "model": "smol",
                    "max_tokens": 16,
                    "messages": [{"role": "user", "content": q}],
                },
            }
            for i, q in enumerate(questions)
        ]
    )
    assert batch.id.startswith("msgbatch_") and batch.processing_status == "in_progress"
    deadline = time.monotonic() + 120
    while batch.processing_status != "ended" and time.monotonic() < deadline:
        time.sleep(0.5)
        batch = client.messages.batches.retrieve(batch.id)
    assert batch.processing_status == "ended"
    assert batch.request_counts.succeeded == 3
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert set(results) == {"q0", "q1", "q2"}
    assert all(r.type == "succeeded" for r in results.values())
    assert "Paris" in results["q0"].message.content[0].text
    assert batch.id in [b.id for b in client.messages.batches.list()]


def test_message_batch_cancel_and_errors(client: anthropic.Anthropic):
    batch = client.messages.batches.create(
        requests=[
            {
                "custom_id": "bad-model",
                "params": {"model": "nope", "max_tokens": 8, "messages": FRANCE},
            },
            *(
                {
                    "custom_id": f"long{i}",
                    "params": {"model": "smol", "max_tokens": 200, "messages": FRANCE},
                }
                for i in range(6)
            ),
        ]
    )
    canceled = client.messages.batches.cancel(batch.id)
    assert canceled.processing_status in ("canceling", "ended")
    deadline = time.monotonic() + 60
    while batch.processing_status != "ended" and time.monotonic() < deadline:
        time.sleep(0.2)
        batch = client.messages.batches.retrieve(batch.id)
    counts = batch.request_counts
    assert counts.processing == 0
    assert counts.canceled + counts.errored + counts.succeeded == 7
    assert counts.canceled >= 1


def test_message_batch_validation(client: anthropic.Anthropic):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.batches.create(
            requests=[{"custom_id": "a", "params": {"model": "smol", "messages": FRANCE}}]
        )
    assert "requests.0.params" in caught.value.message and "max_tokens" in caught.value.message
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve("msgbatch_missing")
