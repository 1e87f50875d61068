"""Per-model and per-request options from issue 16, against one real daemon: parser settings
(tool calling off), chat_template_kwargs, swift-mlx-server's request fields and /v1/rerank."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import openai
import pytest

from mlxd.models.sources import resolve_source
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
# SmolLM2's ChatML template, plus what Qwen3's does with `enable_thinking: false`: an empty
# think block after the generation prompt.
THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
)


def smol_with_thinking_template(workdir: Path, cache_dir: Path) -> Path:
    """SmolLM2 (converted from its GGUF) with THINKING_TEMPLATE: the same weights, linked."""
    converted = resolve_source(SMOL_GGUF, model_name="smol", cache_dir=cache_dir)
    model = workdir / "smol-thinking"
    model.mkdir()
    for item in converted.iterdir():
        if item.name != "tokenizer_config.json":
            (model / item.name).symlink_to(item)
    tokenizer_config = json.loads((converted / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = THINKING_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return model


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    workdir = tmp_path_factory.mktemp("model-options")
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir)},
        "models": {
            "smol": {
                "source": str(smol_with_thinking_template(workdir, mlxd_cache_dir)),
                "context_length": 1024,
                "chat_template_kwargs": {"enable_thinking": False},
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
    running = start_daemon(workdir, config)
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


def prompt_tokens(client: openai.OpenAI, **extra: object) -> int:
    reply = client.chat.completions.create(model="smol", messages=ASK, max_tokens=1, **extra)
    return reply.usage.prompt_tokens


def test_chat_template_kwargs_from_yaml_and_from_the_request(daemon: Daemon, client: openai.OpenAI):
    yaml_default = prompt_tokens(client)  # the model's YAML: enable_thinking false
    thinking = prompt_tokens(client, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    not_thinking = prompt_tokens(
        client, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    # The request's value wins; false renders the empty think block, true does not.
    assert yaml_default == not_thinking > thinking
    # Anthropic requests have no such field, but the model's YAML applies to them too.
    counted = anthropic.Anthropic(base_url=daemon.url, api_key="x", max_retries=0)
    assert counted.messages.count_tokens(model="smol", messages=ASK).input_tokens == yaml_default


def test_chat_template_kwargs_may_not_override_how_mlxd_renders(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="smol",
            messages=ASK,
            extra_body={"chat_template_kwargs": {"add_generation_prompt": False}},
        )
    assert caught.value.body["param"] == "chat_template_kwargs"
