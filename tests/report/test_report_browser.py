"""The report in a real headless browser: plots drawn, no console errors, a screenshot kept.

Driven by Selenium with Debian's chromium + chromium-driver (installed by install_browser.sh
through apt when missing). Selenium rather than Playwright: it talks to the system's
``/usr/bin/chromedriver`` directly (the Service path is set, so Selenium Manager downloads
nothing), whereas Playwright's Python package bundles its own Node driver and expects
browsers fetched by ``playwright install``. The screenshot goes to pytest's tmp dir and, when
``GPUKIT_TEST_ARTIFACTS`` is set, is copied there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpukit.report import write_report

sys.path.insert(0, str(Path(__file__).parent))
from report_helpers import write_record  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
INSTALL = Path(__file__).with_name("install_browser.sh")


def _browser_or_skip() -> None:
    pytest.importorskip("selenium", reason="selenium is not installed (pip install selenium)")
    if os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER):
        return
    try:
        result = subprocess.run(["sh", str(INSTALL)], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"no browser: running {INSTALL.name} failed ({exc})")
    if result.returncode != 0 or not os.path.exists(CHROMEDRIVER):
        reason = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["unknown reason"]
        print(f"browser test skipped: chromium could not be installed: {reason[0]}")
        pytest.skip(f"chromium/chromium-driver could not be installed with apt: {reason[0]}")


@pytest.mark.slow
def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    _browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    report = write_report(write_record(tmp_path / "run"))
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1320,2000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        driver.get(report.as_uri())
        assert driver.title.startswith("gpukit report")
        # every drawn series has a real, non-empty box on screen
        boxes = driver.execute_script(
            "return Array.from(document.querySelectorAll('svg path.series'))"
            ".map(p => { const b = p.getBBox(); return [b.width, b.height, p.getTotalLength()]; });")
        assert len(boxes) >= 12
        assert all(width > 0 and length > 0 for width, _, length in boxes)
        figures = driver.execute_script("return document.querySelectorAll('figure.chart svg').length")
        assert figures >= 8
        straggler = driver.execute_script(
            "const r = document.querySelector('tr.straggler td'); "
            "return [r.textContent, getComputedStyle(r).backgroundColor];")
        assert straggler[0] == "2" and straggler[1] not in ("rgba(0, 0, 0, 0)", "transparent")
        severe = [e for e in driver.get_log("browser") if e.get("level") in ("SEVERE", "ERROR")]
        assert not severe, severe
        shot = tmp_path / "report-screenshot.png"
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        artifacts = os.environ.get("GPUKIT_TEST_ARTIFACTS")
        if artifacts:
            Path(artifacts).mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, Path(artifacts) / shot.name)
    finally:
        driver.quit()
