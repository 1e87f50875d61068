"""API keys and request limits against the real daemon, through both official SDKs."""

from __future__ import annotations

import os
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import yaml

from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

SERVER_KEY = "sk-server-7f3a9c1e"
SMOL_KEY = "sk-smol-42b8d0aa"
OTHER_KEY = "sk-other-c05e11d9"
ADDED_KEY = "sk-added-9e77ab13"
WRONG_KEY = "sk-wrong-5d1f2c3b"
ALL_KEYS = (SERVER_KEY, SMOL_KEY, OTHER_KEY, ADDED_KEY, WRONG_KEY)
HI = [{"role": "user", "content": "Say hi."}]


def config(cache_dir: Path, smol_keys: list[str]) -> dict:
    model = {"source": SMOL_GGUF, "context_length": 512, "max_prompt_tokens": 64}
    return {
        "server": {
            "cache_dir": str(cache_dir),
            "api_keys": [SERVER_KEY],
            "max_request_bytes": "16KiB",
        },
        "models": {
            "smol": {
                **model,
                "aliases": ["default"],
                "api_keys": smol_keys,
                "defaults": {"max_tokens": 4, "temperature": 0.0},
            },
            # Never loaded: permission is decided before a model is needed.
            "other": {**model, "load": "lazy", "api_keys": [OTHER_KEY]},
        },
    }


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    running = start_daemon(tmp_path_factory.mktemp("security"), config(mlxd_cache_dir, [SMOL_KEY]))
    yield running
    running.stop()


def oai(daemon: Daemon, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key=key, max_retries=0)


def claude(daemon: Daemon, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daemon.url, api_key=key, max_retries=0)


def ask_openai(daemon: Daemon, key: str, model: str = "smol") -> str:
    reply = oai(daemon, key).chat.completions.create(model=model, messages=HI)
    return reply.choices[0].message.content


def ask_anthropic(daemon: Daemon, key: str, model: str = "smol") -> str:
    reply = claude(daemon, key).messages.create(model=model, max_tokens=4, messages=HI)
    return reply.content[0].text


def test_no_key_is_401_in_both_dialects(daemon: Daemon):
    chat = httpx.post(f"{daemon.url}/v1/chat/completions", json={"model": "smol", "messages": HI})
    assert chat.status_code == 401
    assert chat.json()["error"]["type"] == "authentication_error"
    messages = httpx.post(
        f"{daemon.url}/v1/messages", json={"model": "smol", "max_tokens": 4, "messages": HI}
    )
    assert messages.status_code == 401
    assert messages.json()["type"] == "error"
    assert messages.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{daemon.url}/v1/models").status_code == 401


def test_wrong_key_is_401_and_never_echoed(daemon: Daemon):
    with pytest.raises(openai.AuthenticationError) as caught:
        ask_openai(daemon, WRONG_KEY)
    assert WRONG_KEY not in caught.value.response.text
    with pytest.raises(anthropic.AuthenticationError) as caught:
        ask_anthropic(daemon, WRONG_KEY)
    assert caught.value.body["error"]["type"] == "authentication_error"
    assert WRONG_KEY not in caught.value.response.text


def test_server_key_may_use_every_model(daemon: Daemon):
    assert ask_openai(daemon, SERVER_KEY)
    assert ask_anthropic(daemon, SERVER_KEY)
    ids = {m.id for m in oai(daemon, SERVER_KEY).models.list()}
    assert ids == {"smol", "default", "other"}


def test_model_key_may_use_its_model_only(daemon: Daemon):
    assert ask_openai(daemon, SMOL_KEY, model="default")  # an alias of its model
    assert ask_anthropic(daemon, SMOL_KEY)
    # Another key's model does not exist for this key: the same 404 as an unknown id,
    # listing only the key's own models (a 403 would tell it which models exist).
    refusals = []
    for model in ("other", "other:latest", "nope"):
        with pytest.raises(openai.NotFoundError) as caught:
            ask_openai(daemon, SMOL_KEY, model=model)
        refusals.append(caught.value.message.replace(model, "<id>"))
    assert len(set(refusals)) == 1 and "available models: default, smol" in refusals[0]
    with pytest.raises(anthropic.NotFoundError) as caught:
        ask_anthropic(daemon, SMOL_KEY, model="other")
    assert caught.value.body["error"]["type"] == "not_found_error"
    assert {m.id for m in oai(daemon, SMOL_KEY).models.list()} == {"smol", "default"}
    with pytest.raises(openai.NotFoundError):
        oai(daemon, SMOL_KEY).models.retrieve("other")


def test_ollama_routes_take_bearer_keys_and_tagged_names(daemon: Daemon):
    import ollama

    def client(key: str | None) -> ollama.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return ollama.Client(host=daemon.url, headers=headers, timeout=60)

    with pytest.raises(ollama.ResponseError) as caught:
        client(None).chat(model="smol", messages=HI)
    assert caught.value.status_code == 401
    # A model key: its model under Ollama's tagged name, and only its model is listed.
    reply = client(SMOL_KEY).chat(model="smol:latest", messages=HI)
    assert reply.done and reply.eval_count > 0
    assert {m.model for m in client(SMOL_KEY).list().models} == {"smol:latest"}
    for model in ("other:latest", "other"):
        with pytest.raises(ollama.ResponseError) as caught:
            client(SMOL_KEY).show(model)
        assert caught.value.status_code == 404
        assert caught.value.error.endswith("available models: default, smol")
    # keep_alive 0 unloads the model for everyone: a model key may not.
    with pytest.raises(ollama.ResponseError) as caught:
        client(SMOL_KEY).generate(model="smol", prompt="", keep_alive=0)
    assert caught.value.status_code == 403
    assert client(SMOL_KEY).chat(model="smol", messages=HI, keep_alive=0).done
    assert daemon.status_with(SERVER_KEY)["models"]["smol"]["state"] == "loaded"
    assert {m.model for m in client(SERVER_KEY).list().models} == {"smol:latest", "other:latest"}


def test_admin_endpoints_need_a_server_key(daemon: Daemon):
    for key in (SMOL_KEY, OTHER_KEY):
        headers = {"Authorization": f"Bearer {key}"}
        assert httpx.get(f"{daemon.url}/v1/status", headers=headers).status_code == 403
        assert httpx.post(f"{daemon.url}/admin/reload", headers=headers).status_code == 403
    assert httpx.get(f"{daemon.url}/v1/status").status_code == 401
    status = httpx.get(f"{daemon.url}/v1/status", headers={"x-api-key": SERVER_KEY})
    assert status.status_code == 200
    assert not any(key in status.text for key in ALL_KEYS)
    health = httpx.get(f"{daemon.url}/health")  # open, for probes: it says only that
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_with_keys_any_host_name_may_be_used(daemon: Daemon):
    headers = {"Host": "mlxd.lan.example.test", "x-api-key": SERVER_KEY}
    assert httpx.get(f"{daemon.url}/v1/models", headers=headers).status_code == 200


def test_a_key_in_a_bad_config_is_never_shown(daemon: Daemon, mlxd_cache_dir: Path):
    secret = "s3cret-key-81f0"
    bad = config(mlxd_cache_dir, [SMOL_KEY])
    port = daemon.config["server"]["port"]
    # `api_keys: s3cret-key`: a string where a list belongs.
    bad["server"] = {**bad["server"], "port": port, "api_keys": secret}
    daemon.config_path.write_text(yaml.safe_dump(bad))
    headers = {"x-api-key": SERVER_KEY}
    reply = httpx.post(f"{daemon.url}/admin/reload", headers=headers, timeout=60)
    assert reply.status_code == 400
    assert "api_keys" in reply.text and secret not in reply.text
    status = httpx.get(f"{daemon.url}/v1/status", headers=headers)
    assert "api_keys" in status.json()["config"]["last_error"]
    for seen in (status.text, httpx.get(f"{daemon.url}/health").text, daemon.log()):
        assert secret not in seen
    rewrite(daemon, config(mlxd_cache_dir, [SMOL_KEY]))


def test_keys_follow_a_hot_reload(daemon: Daemon, mlxd_cache_dir: Path):
    with pytest.raises(openai.AuthenticationError):
        ask_openai(daemon, ADDED_KEY)
    rewrite(daemon, config(mlxd_cache_dir, [ADDED_KEY]))
    assert ask_openai(daemon, ADDED_KEY)
    assert ask_anthropic(daemon, ADDED_KEY)
    with pytest.raises(openai.AuthenticationError):  # removed with the same reload
        ask_openai(daemon, SMOL_KEY)
    rewrite(daemon, config(mlxd_cache_dir, [SMOL_KEY]))
    assert ask_openai(daemon, SMOL_KEY)


def rewrite(daemon: Daemon, new: dict) -> None:
    text = yaml.safe_dump(
        {**new, "server": {**new["server"], "port": daemon.config["server"]["port"]}}
    )
    temp = daemon.config_path.with_suffix(".tmp")
    temp.write_text(text)
    os.replace(temp, daemon.config_path)
    reply = httpx.post(f"{daemon.url}/admin/reload", headers={"x-api-key": SERVER_KEY}, timeout=60)
    assert reply.status_code == 200, reply.text


def test_prompt_over_max_prompt_tokens_is_400_in_both_dialects(daemon: Daemon):
    long = [{"role": "user", "content": "word " * 100}]
    with pytest.raises(openai.BadRequestError) as caught:
        oai(daemon, SERVER_KEY).chat.completions.create(model="smol", messages=long)
    assert "max_prompt_tokens" in caught.value.message
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude(daemon, SERVER_KEY).messages.create(model="smol", max_tokens=4, messages=long)
    assert "max_prompt_tokens" in caught.value.body["error"]["message"]
    stream = claude(daemon, SERVER_KEY).messages.stream(model="smol", max_tokens=4, messages=long)
    with pytest.raises(anthropic.BadRequestError):  # streaming: refused before it starts
        stream.__enter__()


def test_body_over_max_request_bytes_is_413_in_both_dialects(daemon: Daemon):
    big = [{"role": "user", "content": "x" * 20_000}]
    with pytest.raises(openai.APIStatusError) as caught:
        oai(daemon, SERVER_KEY).chat.completions.create(model="smol", messages=big)
    assert caught.value.status_code == 413
    assert "max_request_bytes" in caught.value.message
    with pytest.raises(anthropic.APIStatusError) as caught:
        claude(daemon, SERVER_KEY).messages.create(model="smol", max_tokens=4, messages=big)
    assert caught.value.status_code == 413
    assert caught.value.body["error"]["type"] == "request_too_large"


def test_keys_never_reach_the_log(daemon: Daemon):
    log = daemon.log()
    assert "API keys required" in log
    assert not any(key in log for key in ALL_KEYS)
