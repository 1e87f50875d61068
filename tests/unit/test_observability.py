"""The OpenAPI document covers every route; logs, recent-window figures and `ps` rows."""

from __future__ import annotations

import asyncio
import json
import logging

from openapi_spec_validator import validate

from mlxd.api.app import create_app
from mlxd.api.ops.metrics import Recent
from mlxd.api.ops.openapi import document
from mlxd.cli.main import _ps_row
from mlxd.config import Config
from mlxd.daemon import Daemon
from mlxd.logs import JsonFormatter


def test_openapi_document_is_valid():
    validate(document())


def test_openapi_lists_every_route_of_the_app():
    app = create_app(Daemon(Config()))
    served = {
        (method.lower(), rule.rule.replace("<path:", "{").replace("<", "{").replace(">", "}"))
        for rule in app.url_map.iter_rules()
        if rule.endpoint != "static"
        for method in rule.methods - {"HEAD", "OPTIONS"}
    }
    documented = {(m, path) for path, ops in document()["paths"].items() for m in ops}
    assert served == documented


def test_openapi_bodies_are_the_validation_models():
    chat = document()["paths"]["/v1/chat/completions"]["post"]
    ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = document()["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"model", "messages", "max_tokens", "stream"} <= set(schema["properties"])
    assert "messages" in schema["required"]


def test_openapi_summaries_say_what_the_routes_answer():
    # /api/pull was listed as a 501 after it had come to answer Ollama's success stream.
    operations = [
        (method, path)
        for path, ops in document()["paths"].items()
        for method, op in ops.items()
        if op["summary"].startswith("501")
    ]

    async def statuses() -> list[int]:
        client = create_app(Daemon(Config())).test_client()
        return [
            (await client.open(path, method=m.upper(), json={})).status_code
            for m, path in operations
        ]

    assert ("post", "/api/push") in operations and ("post", "/api/pull") not in operations
    assert asyncio.run(statuses()) == [501] * len(operations)
    pull = document()["paths"]["/api/pull"]["post"]
    ref = pull["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert {"model", "name", "stream"} <= set(
        document()["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]
    )


def test_json_log_lines_carry_request_fields():
    record = logging.LogRecord("mlxd.access", logging.INFO, "", 0, "request %s", ("x",), None)
    record.fields = {"request_id": "req_1", "status": 200}
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "request x" and line["level"] == "info"
    assert line["request_id"] == "req_1" and line["status"] == 200


def test_recent_window_forgets_old_tokens_and_ranks_ttft():
    recent = Recent()
    recent.add_tokens(600, now=1000.0)
    recent.add_tokens(60, now=1030.0)
    assert recent.summary(now=1031.0)["tokens_per_s"] == 11.0
    assert recent.summary(now=1070.0)["tokens_per_s"] == 1.0  # the first second aged out
    for ttft in (0.1, 0.2, 0.3, 0.4, 5.0):
        recent.add_ttft(ttft, now=1070.0)
    summary = recent.summary(now=1071.0)
    assert summary["ttft_p50_s"] == 0.3 and summary["ttft_p95_s"] == 5.0
    assert Recent().summary(now=0.0)["ttft_p50_s"] is None


def test_ps_row_for_loaded_and_unloaded_models():
    loaded = {
        "kind": "llm",
        "state": "loaded",
        "aliases": ["a", "b"],
        "pid": 4242,
        "rss_bytes": 7 * 2**20,
        "memory_estimate_bytes": 3 * 2**20,
        "memory_bytes": 7 * 2**20,
        "mlx_active_bytes": 6 * 2**20,
        "running": 2,
        "queue_depth": 5,
        "tokens_per_s": 12.345,
        "cpu_path": {"plan": "mixed", "summary": "packed decode (…), float32 prefill (…)"},
    }
    assert _ps_row("m", loaded) == (
        ("m", "llm", "loaded", "a,b", "4242", "7MiB", "3MiB", "6MiB", "mixed", "5", "2", "12.3")
    )
    unloaded = {"kind": "llm", "state": "unloaded", "aliases": []}
    assert _ps_row("n", unloaded) == ("n", "llm", "unloaded", *["-"] * 9)
