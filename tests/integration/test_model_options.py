"""Per-model and per-request options from issue 16, against one real daemon: parser settings
(tool calling off), chat_template_kwargs, swift-mlx-server's request fields and /v1/rerank."""

from __future__ import annotations

from pathlib import Path

import anthropic
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
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
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
                "defaults": {"max_tokens": 16, "temperature": 0.0},
            },
            # Same weights, kept quantized and loaded on first use: only its settings matter.
            "notools": {
                "source": SMOL_GGUF,
                "load": "lazy",
                "dtype": "keep",
                "parsers": {"tool_calls": None},
                "defaults": {"max_tokens": 8, "temperature": 0.0},
            },
        },
    }
    running = start_daemon(tmp_path_factory.mktemp("model-options"), config)
    yield running
    running.stop()


@pytest.fixture
def client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="x", max_retries=0)


def test_tool_calling_off_refuses_tools_and_holds_no_slot(daemon: Daemon, client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="notools", messages=ASK, tools=[WEATHER])
    assert caught.value.body["param"] == "tools"
    assert "parsers.tool_calls: null" in caught.value.body["message"]
    with pytest.raises(anthropic.BadRequestError, match="tool calling turned off"):
        anthropic.Anthropic(base_url=daemon.url, api_key="x", max_retries=0).messages.create(
            model="notools",
            max_tokens=8,
            messages=ASK,
            tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
        )
    # The refusal came before anything was submitted: no sequence runs on, holding a slot.
    stats = daemon.status()["models"]["notools"]
    assert (stats["running"], stats["waiting"]) == (0, 0)
    # Off means tools are refused, not the model: without tools (or with tool_choice none)
    # it answers.
    assert client.chat.completions.create(model="notools", messages=ASK).choices[0].message
    reply = client.chat.completions.create(
        model="notools", messages=ASK, tools=[WEATHER], tool_choice="none"
    )
    assert reply.choices[0].message.tool_calls is None
