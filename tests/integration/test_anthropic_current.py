"""The current Anthropic surface end to end with the official SDK: system-role messages,
thinking, output_config, assistant prefill, beta headers, a coding agent's request replayed
from a fixture, and the MLX server's /v1/messages/batch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).parents[1] / "fixtures" / "claude_code_request.json"
AGENT_MODEL = "claude-sonnet-5-5"  # the id the fixture asks for: an alias here
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
PLACE = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir)},
        "models": {
            "smol": {
                "source": SMOL_GGUF,
                "aliases": [AGENT_MODEL],
                # Room for a coding agent's prompt (SmolLM2 was trained on 8k).
                "context_length": 8192,
                # SmolLM2 does not reason on its own; a prefill that opens <think> makes it.
                "parsers": {"reasoning": "think"},
                "defaults": {"temperature": 0.0},
            }
        },
    }
    running = start_daemon(tmp_path_factory.mktemp("anthropic-current"), config)
    yield running
    running.stop()


@pytest.fixture
def client(daemon: Daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daemon.url, api_key="x", max_retries=0)


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_system_role_messages_anywhere_in_messages(client: anthropic.Anthropic):
    system_turn = {"role": "system", "content": "Answer in one word."}
    plain = client.messages.count_tokens(model="smol", messages=FRANCE).input_tokens
    with_turn = client.messages.count_tokens(model="smol", messages=[*FRANCE, system_turn])
    assert with_turn.input_tokens > plain
    for messages in ([system_turn, *FRANCE], [*FRANCE, system_turn]):
        reply = client.messages.create(model="smol", max_tokens=16, messages=messages)
        assert reply.stop_reason in ("end_turn", "max_tokens") and text_of(reply)


@pytest.mark.parametrize(
    "thinking",
    [{"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}, {"type": "disabled"}],
    ids=lambda t: t["type"],
)
def test_thinking_is_never_an_error_for_a_model_that_does_not_reason(
    client: anthropic.Anthropic, thinking: dict
):
    reply = client.messages.create(
        model="smol",
        max_tokens=32,
        messages=FRANCE,
        thinking=thinking,
        output_config={"effort": "high"},
    )
    assert [block.type for block in reply.content] == ["text"]
    assert "Paris" in text_of(reply)


def test_thinking_blocks_come_out_when_the_model_reasons(client: anthropic.Anthropic):
    reasoning = [*FRANCE, {"role": "assistant", "content": "<think>"}]
    shown = client.messages.create(
        model="smol", max_tokens=16, messages=reasoning, thinking={"type": "adaptive"}
    )
    assert shown.content[0].type == "thinking" and shown.content[0].thinking.strip()
    hidden = client.messages.create(
        model="smol", max_tokens=16, messages=reasoning, thinking={"type": "disabled"}
    )
    assert all(block.type != "thinking" for block in hidden.content)
    with client.messages.stream(
        model="smol",
        max_tokens=16,
        messages=reasoning,
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].thinking == shown.content[0].thinking


def test_output_config_format_follows_the_json_schema(client: anthropic.Anthropic):
    reply = client.messages.create(
        model="smol",
        max_tokens=48,
        messages=[{"role": "user", "content": "Name a city and its country."}],
        output_config={"effort": "low", "format": {"type": "json_schema", "schema": PLACE}},
    )
    place = json.loads(text_of(reply))
    assert set(place) == {"city", "country"} and all(isinstance(v, str) for v in place.values())


def test_assistant_prefill_continues_the_turn(client: anthropic.Anthropic):
    prefill = "The capital of France is"
    messages = [*FRANCE, {"role": "assistant", "content": prefill}]
    reply = client.messages.create(model="smol", max_tokens=8, messages=messages)
    assert "Paris" in text_of(reply) and not text_of(reply).startswith(prefill)
    fresh = client.messages.create(model="smol", max_tokens=8, messages=FRANCE)
    # The prefill is in the prompt: it costs input tokens and is not generated again.
    assert reply.usage.input_tokens > fresh.usage.input_tokens
    with client.messages.stream(model="smol", max_tokens=8, messages=messages) as stream:
        assert "".join(stream.text_stream) == text_of(reply)


def test_max_tokens_0_prefills_the_prompt_and_answers_nothing(client: anthropic.Anthropic):
    warm = client.messages.create(model="smol", max_tokens=0, messages=FRANCE)
    assert warm.content == [] and warm.stop_reason == "max_tokens"
    assert warm.usage.output_tokens == 0 and warm.usage.input_tokens > 5
    with client.messages.stream(model="smol", max_tokens=0, messages=FRANCE) as stream:
        streamed = stream.get_final_message()
    assert streamed.content == [] and streamed.usage.output_tokens == 0


def test_beta_endpoint_headers_and_fields_are_accepted(client: anthropic.Anthropic):
    reply = client.beta.messages.create(
        model="smol",
        max_tokens=8,
        messages=[
            {"role": "system", "content": "Be brief.", "clear_at": "next_user_message"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}],
            },
        ],
        system=[
            {
                "type": "text",
                "text": "You help.",
                "cache_control": {"type": "ephemeral", "ttl": "1h"},
            }
        ],
        betas=["context-management-2025-06-27", "interleaved-thinking-2025-05-14"],
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        metadata={"user_id": "user_0123"},
        thinking={"type": "adaptive"},
        service_tier="auto",
    )
    assert reply.stop_reason in ("end_turn", "max_tokens")


# -- a coding agent's request --------------------------------------------------------------


def agent_request() -> tuple[dict[str, str], dict[str, Any]]:
    """The fixture's headers and body, with max_tokens small: the point is the prompt."""
    recorded = json.loads(FIXTURE.read_text())
    return recorded["headers"], {**recorded["body"], "max_tokens": 24}


def test_fixture_is_shaped_like_a_current_coding_agent_request():
    _, body = agent_request()
    assert len(body["tools"]) >= 20
    assert any(m["role"] == "system" for m in body["messages"])
    assert all("cache_control" in block for block in body["system"])
    assert {"thinking", "output_config", "metadata", "context_management"} <= set(body)


def assert_well_formed(message: Any, tools: list[dict[str, Any]]) -> None:
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert message.content and message.usage.output_tokens > 0
    for block in message.content:
        assert block.type in ("text", "thinking", "tool_use")
        if block.type == "tool_use":
            assert block.name in {tool["name"] for tool in tools}
            assert isinstance(block.input, dict)


def test_coding_agent_request_replayed_with_the_sdk(client: anthropic.Anthropic):
    headers, body = agent_request()
    params = {key: value for key, value in body.items() if key != "stream"}
    betas = headers["anthropic-beta"].split(",")
    with client.beta.messages.stream(**params, betas=betas) as stream:
        message = stream.get_final_message()
    assert message.model == AGENT_MODEL
    assert_well_formed(message, body["tools"])
    # The whole prompt was read: tools, system blocks, every turn.
    counted = client.beta.messages.count_tokens(
        **{k: v for k, v in params.items() if k not in ("max_tokens", "metadata")}, betas=betas
    )
    assert message.usage.input_tokens == counted.input_tokens > 2000


def test_coding_agent_request_replayed_raw(daemon: Daemon):
    headers, body = agent_request()
    events = []
    with httpx.stream(
        "POST",
        f"{daemon.url}/v1/messages?beta=true",
        json=body,
        headers={**headers, "x-api-key": "x"},
        timeout=600,
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    kinds = [event["type"] for event in events if event["type"] != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in kinds and "error" not in kinds
    assert events[0]["message"]["usage"]["input_tokens"] > 2000


# -- /v1/messages/batch (the MLX Anthropic server's shape) ----------------------------------


def test_messages_batch_list_in_results_out(daemon: Daemon):
    requests = [
        {"model": "smol", "max_tokens": 16, "messages": FRANCE},
        {"model": "smol", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]},
        {"model": "smol", "messages": FRANCE},  # no max_tokens: fails alone
        {"model": "nope", "max_tokens": 8, "messages": FRANCE},
    ]
    response = httpx.post(f"{daemon.url}/v1/messages/batch", json=requests, timeout=300)
    assert response.status_code == 200, response.text
    first, second, invalid, unknown = response.json()["results"]
    assert first["type"] == "message" and "Paris" in first["content"][0]["text"]
    assert second["type"] == "message" and second["usage"]["output_tokens"] > 0
    assert invalid["type"] == "error" and "max_tokens" in invalid["error"]["message"]
    assert unknown["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("body", [b"[]", b'{"model": "smol"}', b"[{"])
def test_messages_batch_needs_a_list(daemon: Daemon, body: bytes):
    response = httpx.post(f"{daemon.url}/v1/messages/batch", content=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
