"""A daemon a household can put on its LAN, against the real daemon with no keys set (the
default): web pages cannot reach it by DNS rebinding or cross-site posts, configured browser
origins can, and every dialect refuses resource bombs with a 400 naming its own field."""

from __future__ import annotations

import base64
import io
import time
from pathlib import Path

import httpx
import ollama
import openai
import pytest

from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

APP_ORIGIN = "http://chat.example.test:3000"
EVIL_ORIGIN = "http://evil.example.test"
LAN_NAME = "mlxd.home.arpa"
HI = [{"role": "user", "content": "Say hi."}]
MILLION_STOPS = ["x"] * 1_000_000


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    config = {
        "server": {
            "cache_dir": str(mlxd_cache_dir),
            "allowed_hosts": [LAN_NAME],
            "cors_origins": [APP_ORIGIN],
        },
        "models": {
            "smol": {
                "source": SMOL_GGUF,
                "context_length": 512,
                "defaults": {"max_tokens": 2, "temperature": 0.0},
            },
        },
    }
    running = start_daemon(tmp_path_factory.mktemp("lan"), config)
    yield running
    running.stop()


def post(daemon: Daemon, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{daemon.url}{path}", timeout=120, **kwargs)


def reloads(daemon: Daemon) -> int:
    return daemon.status()["config"]["generation"]


def test_a_rebinding_host_is_refused_while_no_key_is_set(daemon: Daemon):
    port = daemon.config["server"]["port"]
    for host in ("attacker.example.test", f"attacker.example.test:{port}"):
        reply = httpx.get(f"{daemon.url}/v1/models", headers={"Host": host})
        assert reply.status_code == 403
        assert "server.allowed_hosts" in reply.json()["error"]["message"]
    before = reloads(daemon)
    refused = post(daemon, "/admin/reload", headers={"Host": "attacker.example.test"})
    assert refused.status_code == 403
    assert reloads(daemon) == before
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"{LAN_NAME}:{port}", "192.168.1.9"):
        assert httpx.get(f"{daemon.url}/v1/models", headers={"Host": host}).status_code == 200


def test_a_cross_site_text_plain_post_is_refused(daemon: Daemon):
    """What `fetch(url, {method: "POST", mode: "no-cors", body})` sends from another site."""
    before = reloads(daemon)
    body = '{"model": "smol", "messages": [{"role": "user", "content": "hi"}]}'
    for path in ("/v1/chat/completions", "/api/chat", "/admin/reload"):
        reply = post(
            daemon,
            path,
            content=body,
            headers={"Content-Type": "text/plain", "Origin": EVIL_ORIGIN},
        )
        assert reply.status_code == 403, path
        assert "access-control-allow-origin" not in reply.headers
    # A browser that leaves Origin out still says where the request came from.
    no_origin = post(
        daemon,
        "/admin/reload",
        content=body,
        headers={"Content-Type": "text/plain", "Sec-Fetch-Site": "cross-site"},
    )
    assert no_origin.status_code == 403
    assert reloads(daemon) == before
    # Same origin, but not JSON: a page's form post, refused too.
    same_origin = post(
        daemon,
        "/api/chat",
        content=body,
        headers={"Content-Type": "text/plain", "Origin": daemon.url},
    )
    assert same_origin.status_code == 415
    assert "application/json" in same_origin.json()["error"]


def test_a_configured_origin_works_with_cors(daemon: Daemon):
    preflight = httpx.options(
        f"{daemon.url}/v1/chat/completions",
        headers={
            "Origin": APP_ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"]
    reply = post(
        daemon,
        "/v1/chat/completions",
        json={"model": "smol", "messages": HI},
        headers={"Origin": APP_ORIGIN},
    )
    assert reply.status_code == 200, reply.text
    assert reply.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "x-request-id" in reply.headers["access-control-expose-headers"]
    # Another origin's preflight gets no CORS approval.
    evil = httpx.options(
        f"{daemon.url}/v1/chat/completions",
        headers={"Origin": EVIL_ORIGIN, "Access-Control-Request-Method": "POST"},
    )
    assert evil.status_code == 403
    assert "access-control-allow-origin" not in evil.headers


def test_clients_that_are_not_browsers_are_unaffected(daemon: Daemon):
    client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="none", max_retries=0)
    assert client.chat.completions.create(model="smol", messages=HI).choices
    assert {m.model for m in ollama.Client(host=daemon.url).list().models} == {"smol:latest"}
    # `curl -d '{...}'` sends a form content type; Ollama's docs post that way.
    curl = post(
        daemon,
        "/api/generate",
        content='{"model": "smol", "prompt": "hi", "stream": false}',
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert curl.status_code == 200, curl.text


def test_a_million_stops_is_refused_in_every_dialect(daemon: Daemon):
    anthropic = post(
        daemon,
        "/v1/messages",
        json={"model": "smol", "max_tokens": 2, "messages": HI, "stop_sequences": MILLION_STOPS},
    )
    assert anthropic.status_code == 400
    assert anthropic.json()["error"]["type"] == "invalid_request_error"
    assert "stop_sequences" in anthropic.json()["error"]["message"]
    ollama_reply = post(
        daemon,
        "/api/chat",
        json={"model": "smol", "messages": HI, "stream": False, "options": {"stop": MILLION_STOPS}},
    )
    assert ollama_reply.status_code == 400
    assert ollama_reply.json()["error"].startswith("options.stop")
    openai_reply = post(
        daemon,
        "/v1/chat/completions",
        json={"model": "smol", "messages": HI, "stop": MILLION_STOPS},
    )
    assert openai_reply.status_code == 400
    assert openai_reply.json()["error"]["param"] == "stop"
    # OpenAI's own cap is 16 stops; their length is capped as in every dialect.
    long_stop = post(
        daemon,
        "/v1/chat/completions",
        json={"model": "smol", "messages": HI, "stop": ["y" * 100_000]},
    )
    assert long_stop.status_code == 400
    assert long_stop.json()["error"]["param"] == "stop"
    # Counting tokens builds the same request: the same caps.
    count = post(
        daemon,
        "/v1/messages/count_tokens",
        json={"model": "smol", "messages": HI, "tools": _tools(300)},
    )
    assert count.status_code == 400
    assert "tools" in count.json()["error"]["message"]


def _tools(count: int) -> list[dict]:
    return [
        {"name": f"tool_{i}", "description": "d", "input_schema": {"type": "object"}}
        for i in range(count)
    ]


def test_fan_out_and_images_are_capped(daemon: Daemon):
    prompts = post(daemon, "/v1/completions", json={"model": "smol", "prompt": ["hi"] * 10, "n": 8})
    assert prompts.status_code == 400
    assert prompts.json()["error"]["param"] == "n"
    image = _png_data_url(8, 8)
    content = [{"type": "text", "text": "hi"}] + [
        {"type": "image_url", "image_url": {"url": image}} for _ in range(40)
    ]
    many = post(
        daemon,
        "/v1/chat/completions",
        json={"model": "smol", "messages": [{"role": "user", "content": content}]},
    )
    assert many.status_code == 400
    assert many.json()["error"]["param"] == "images"


def _png_data_url(width: int, height: int) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("1", (width, height)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_a_model_id_cannot_forge_a_log_line(daemon: Daemon):
    forged = "nope\n2026-01-01 00:00:00,000 INFO    mlxd.access: request model=smol"
    reply = post(daemon, "/v1/chat/completions", json={"model": forged, "messages": HI})
    assert reply.status_code == 404
    deadline = time.monotonic() + 30  # the access line is written as the response ends
    while "nope" not in daemon.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    lines = daemon.log().splitlines()
    assert any("nope" in line for line in lines)
    assert not any(line.startswith("2026-01-01") for line in lines)
