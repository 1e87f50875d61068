"""Headless Chromium driven by selenium, for the dashboard's browser tests.

Debian's `chromium` and `chromium-driver` (the Makefile's system-deps) are used where present;
without them the tests that need a browser are skipped.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

T = TypeVar("T")


def chromium_paths() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def start_browser(width: int = 1280, height: int = 900):
    """A headless Chromium session, or skip the test when there is none."""
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    paths = chromium_paths()
    if paths is None:
        pytest.skip("chromium and chromium-driver are not installed (make system-deps)")
    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for argument in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root in a container
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={width},{height}",
    ):
        options.add_argument(argument)
    return webdriver.Chrome(options=options, service=Service(paths[1]))


def eventually(probe: Callable[[], T], timeout: float = 60.0, interval: float = 0.1) -> T:
    """Poll `probe` until it returns something truthy. The page re-renders its tables every
    couple of seconds, so a probe that catches a replaced element simply runs again."""
    from selenium.common.exceptions import (
        NoSuchElementException,
        StaleElementReferenceException,
    )

    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = probe()
            if value:
                return value
        except (StaleElementReferenceException, NoSuchElementException) as exc:
            last_error = exc
        time.sleep(interval)
    raise AssertionError(f"not reached within {timeout}s (last error: {last_error!r})")


def screenshot(driver, path: Path, element_id: str | None = None) -> Path:
    """The browser window as a PNG under the test's tmp dir, scrolled to `element_id`."""
    if element_id is not None:
        driver.execute_script(
            "document.getElementById(arguments[0]).scrollIntoView({block: 'center'})", element_id
        )
    driver.save_screenshot(str(path))
    return path
