"""A real browser for the dashboard tests: Debian's chromium, headless, driven through its WebDriver
(chromedriver) with selenium; `tests/install_browser.sh` installs both. Also a command that saves the
dashboard's two views of a running stack as PNGs:

    python -m tests.integration.browser http://127.0.0.1:PORT/ OUT_DIR
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHROMEDRIVER = "/usr/bin/chromedriver"


def missing() -> str | None:
    """Why no browser can run here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    if shutil.which("chromium") is None or not Path(CHROMEDRIVER).exists():
        return "Debian's chromium and chromium-driver are not installed (tests/install_browser.sh, as root)"
    return None


def start_browser(width: int = 1500, height: int = 1100) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))


def wait_for(condition: Callable[[], Any], *, timeout_s: float = 120.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = condition()
        except Exception:  # an element not there yet
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


def console_errors(driver: Any) -> list[str]:
    """SEVERE entries of the browser's console since the last call (JavaScript errors, failed loads)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def open_rollouts(driver: Any) -> None:
    """Switch to the rollout browser and wait until a batch is drawn."""
    from selenium.webdriver.common.by import By

    driver.find_element(By.CSS_SELECTOR, "nav button[data-view=rollouts]").click()
    wait_for(lambda: driver.find_element(By.ID, "groups").get_attribute("data-batch"), what="a batch drawn")


def screenshots(url: str, out_dir: Path, *, min_steps: int = 1) -> tuple[Path, Path]:
    """The overview (once it shows `min_steps` steps) and the rollout browser, as PNGs in `out_dir`."""
    from selenium.webdriver.common.by import By

    out_dir.mkdir(parents=True, exist_ok=True)
    driver = start_browser()
    try:
        driver.get(url)
        wait_for(lambda: int(driver.find_element(By.ID, "connection").get_attribute("data-steps") or 0) >= min_steps,
                 what=f"{min_steps} steps on the page")
        overview = out_dir / "dashboard-overview.png"
        driver.save_screenshot(str(overview))
        open_rollouts(driver)
        rollouts = out_dir / "dashboard-rollouts.png"
        driver.save_screenshot(str(rollouts))
        return overview, rollouts
    finally:
        driver.quit()


if __name__ == "__main__":
    for path in screenshots(sys.argv[1], Path(sys.argv[2]), min_steps=int(sys.argv[3]) if len(sys.argv) > 3 else 1):
        print(path)
