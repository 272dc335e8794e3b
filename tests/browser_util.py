"""A real headless Chromium for tests: Debian's `chromium` and `chromium-driver`, driven by selenium."""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from typing import Any, Iterator

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
MISSING = "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"


@contextmanager
def chromium(window: tuple[int, int] = (1280, 900), script_timeout: float = 30) -> Iterator[Any]:
    """A headless Chromium whose console (`driver.get_log("browser")`) the test can read."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    assert CHROMIUM and CHROMEDRIVER, MISSING
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--no-first-run", "--disable-extensions", f"--window-size={window[0]},{window[1]}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_script_timeout(script_timeout)
    try:
        yield driver
    finally:
        driver.quit()


def console_errors(driver: Any) -> list[str]:
    """The console's errors since the last read (reading drains the log)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
