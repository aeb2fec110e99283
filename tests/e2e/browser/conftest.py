"""Session fixtures for the browser tests: Debian's Chromium, a private JupyterLab, one browser.

The processes themselves are in ``browser_services.py``; each is stopped by its own pid when the
session ends, also when a test failed. Screenshots go to ``screenshots/`` at the repository root
(gitignored); the end of the run lists each notebook's timings and where the screenshots are.

Run alone:  ``.venv/bin/python -m pytest tests/e2e/browser -o addopts="" -p no:cacheprovider``
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, sync_playwright

from .browser_services import (
    SCREENSHOTS_DIR,
    Lab,
    ServiceError,
    copy_workbook,
    default_tabs,
    ensure_chromium,
    running_chromium,
    running_jupyterlab,
)
from .workbook_runner import BrowserReport

REPORT = pytest.StashKey[BrowserReport]()


@pytest.fixture(scope="session")
def chromium() -> Path:
    try:
        return ensure_chromium()
    except ServiceError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """JupyterLab on 127.0.0.1 serving a copy of the notebooks; the committed files are never touched."""
    work = tmp_path_factory.mktemp("workbook")
    try:
        with running_jupyterlab(copy_workbook(work), work / "jupyter", default_tabs()) as server:
            yield server
    except ServiceError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def browser(chromium: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    """Debian's Chromium with a new empty profile, driven by Playwright over the DevTools protocol."""
    try:
        with running_chromium(chromium, tmp_path_factory.mktemp("chromium-profile")) as endpoint, \
                sync_playwright() as playwright:
            browser = playwright.chromium.connect_over_cdp(endpoint)
            try:
                yield browser
            finally:
                browser.close()
    except ServiceError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def browser_report(request: pytest.FixtureRequest) -> BrowserReport:
    """Tests add their lines and screenshots here; the run's summary prints them."""
    SCREENSHOTS_DIR.mkdir(exist_ok=True)
    return request.config.stash.setdefault(REPORT, BrowserReport())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    report = config.stash.get(REPORT, None)
    if report is None or not (report.lines or report.screenshots):
        return
    terminalreporter.section("the workbook in JupyterLab (tests/e2e/browser)")
    for line in report.lines:
        terminalreporter.write_line(line)
    terminalreporter.write_line(f"{len(report.screenshots)} screenshot(s) in {SCREENSHOTS_DIR}/")
