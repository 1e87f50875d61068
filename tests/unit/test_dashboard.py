"""The dashboard's ring buffers, its routes through Quart's test client (no daemon, no
weights), and that every file the page references ships in the package."""

from __future__ import annotations

import asyncio
import re
from importlib.resources import files

from mlxd.api.app import create_app
from mlxd.api.ops.dashboard.history import History, RequestLog, Sample
from mlxd.api.ops.metrics import Recent
from mlxd.config import Config, ServerConfig
from mlxd.daemon import Daemon

STATIC = files("mlxd.api.ops.dashboard") / "static"


def line(model: str, endpoint: str = "/v1/chat/completions", **extra) -> dict:
    return {"request_id": "req", "model": model, "endpoint": endpoint, "status": 200, **extra}


def test_history_keeps_fifteen_minutes_per_model():
    history = History(interval_s=5, span_s=900)
    for i in range(200):
        history.add("smol", Sample(1000.0 + 5 * i, float(i), i % 3, 0))
    series = history.series(now=1000.0 + 5 * 199)
    assert len(series["smol"]) == 180  # the ring holds span / interval samples
    assert series["smol"][-1]["tokens_per_s"] == 199.0
    # A model removed long ago drops out once its samples are older than the span.
    assert history.series(now=1000.0 + 5 * 199 + 901) == {}


def test_request_log_keeps_the_last_lines_newest_first_and_filters():
    log = RequestLog(size=3)
    for i, model in enumerate(["smol", "minilm", "smol", "smol"]):
        log.add(line(model, request_id=f"r{i}"), at=float(i))
    log.add(line(None, endpoint="/dashboard/api/state"), at=9.0)  # the page's own polling
    log.add(line(None, endpoint="/"), at=9.0)  # a liveness probe
    assert [entry["request_id"] for entry in log.lines()] == ["r3", "r2", "r1"]
    assert [entry["request_id"] for entry in log.lines("minilm")] == ["r1"]


def test_rate_counts_whole_seconds_of_the_window():
    recent = Recent()
    recent.add_tokens(10, now=100.2)
    recent.add_tokens(20, now=104.5)
    recent.add_tokens(99, now=105.1)  # the current second is still filling: not counted
    assert recent.rate(now=105.5, window_s=5) == 6.0  # 30 tokens over seconds 100..104
    assert recent.rate(now=130.0, window_s=5) == 0.0


def test_every_file_the_page_references_ships_in_the_package():
    shipped = {entry.name for entry in STATIC.iterdir()}
    html = (STATIC / "index.html").read_text()
    referenced = set(re.findall(r"/dashboard/static/([\w.-]+)", html))
    for script in [name for name in shipped if name.endswith(".js")]:
        referenced |= set(re.findall(r'from "\./([\w.-]+)"', (STATIC / script).read_text()))
    assert referenced and referenced <= shipped


def request(daemon: Daemon, method: str, path: str, key: str | None = None):
    async def go():
        client = create_app(daemon).test_client()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = await client.open(path, method=method, headers=headers)
        return response.status_code, response.content_type, await response.get_data()

    return asyncio.run(go())


def test_page_static_and_state_without_keys():
    daemon = Daemon(Config())
    status, content_type, body = request(daemon, "GET", "/")
    assert status == 200 and content_type.startswith("text/html") and b"<h1>mlxd</h1>" in body
    assert request(daemon, "HEAD", "/")[0] == 200  # clients probe / for liveness
    status, content_type, _ = request(daemon, "GET", "/dashboard/static/app.js")
    assert status == 200 and content_type.startswith("text/javascript")
    assert request(daemon, "GET", "/dashboard/static/nope.js")[0] == 404
    assert request(daemon, "GET", "/dashboard/static/..%2Froutes.py")[0] == 404
    status, _, body = request(daemon, "GET", "/dashboard/api/state")
    assert status == 200 and b'"history"' in body and b'"last_actions"' in body


def test_keys_guard_the_data_not_the_page():
    daemon = Daemon(Config(server=ServerConfig(api_keys=["secret"])))
    assert request(daemon, "GET", "/")[0] == 200
    assert request(daemon, "GET", "/dashboard/static/style.css")[0] == 200
    assert request(daemon, "GET", "/dashboard/api/state")[0] == 401
    assert request(daemon, "GET", "/dashboard/api/state", "secret")[0] == 200


def test_dashboard_false_is_a_404():
    daemon = Daemon(Config(server=ServerConfig(dashboard=False)))
    assert request(daemon, "GET", "/")[0] == 404
    assert request(daemon, "GET", "/dashboard/api/state")[0] == 404
    assert request(daemon, "GET", "/health")[0] != 404


def test_access_lines_reach_the_request_log():
    async def go():
        client = create_app(Daemon(Config())).test_client()
        await client.get("/v1/models")
        await client.get("/dashboard/api/state")  # the page itself is not logged
        return (await (await client.get("/dashboard/api/state")).get_json())["requests"]

    requests = asyncio.run(go())
    assert [(r["endpoint"], r["status"]) for r in requests] == [("/v1/models", 200)]
    assert {"request_id", "duration_ms", "at"} <= set(requests[0])


def test_events_stream_the_state_and_end_when_the_daemon_drains():
    daemon = Daemon(Config())

    async def go():
        client = create_app(daemon).test_client()

        async def drain_soon():
            await asyncio.sleep(0.5)
            daemon.draining = True  # a shutdown must not wait for an open dashboard

        drain = asyncio.create_task(drain_soon())
        response = await asyncio.wait_for(client.get("/dashboard/api/events"), timeout=30)
        await drain
        return response.content_type, (await response.get_data()).decode()

    content_type, body = asyncio.run(go())
    assert content_type.startswith("text/event-stream")
    events = [block for block in body.split("\n\n") if block]
    assert events and all(block.startswith("event: state\ndata: {") for block in events)
