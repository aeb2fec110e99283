"""Run many notebooks in JupyterLab at once, a few tabs at a time, and keep what each one showed.

A notebook's run is mostly its kernel computing; the browser waits. So ``run_workbook`` keeps up to
``tabs`` notebooks running side by side (each in its own browser context, JupyterLab workspace and
kernel), polls them, and as each finishes it saves, reads the page (``find_problems``), moves the first
widget that drives an output, takes the screenshot, closes the tab and shuts the kernel down before
opening the next. ``LABKIT_BROWSER_TABS`` overrides the number of tabs (default: 2, or 1 on one core).
A notebook that fails, hangs or breaks the driver is recorded as a problem of that notebook only.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from playwright.sync_api import Browser

from .browser_services import Lab, default_tabs
from .jupyterlab_page import RUN_TIMEOUT_S, NotebookPage, WidgetMove
from .notebook_problems import find_problems

POLL_S = 0.5


@dataclass
class NotebookResult:
    """What running one notebook in JupyterLab showed: problems (empty when all is well) and timings."""

    name: str
    problems: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # open, run, check, widget, screenshot
    widget: WidgetMove | None = None
    screenshot: Path | None = None

    def summary(self) -> str:
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items())
        moved = f"{self.widget.kind} moved, output {'changed' if self.widget.changed else 'UNCHANGED'}" \
            if self.widget else "no widget drives an output"
        return f"{self.name}: {phases}; {moved}; screenshot {self.screenshot}"


@dataclass
class BrowserReport:
    """What the end of the test run prints: a line per notebook run in the browser, and the screenshots."""

    lines: list[str] = field(default_factory=list)
    screenshots: list[Path] = field(default_factory=list)


class _Tab:
    """One notebook in flight: its page, its result, and when its run started."""

    def __init__(self, browser: Browser, lab: Lab, name: str) -> None:
        self.result = NotebookResult(name)
        start = time.monotonic()
        self.page = NotebookPage(browser, lab, name)
        self.page.start_run_all()
        self.started = time.monotonic()
        self.result.seconds["open"] = self.started - start


def _finish(tab: _Tab, screenshots_dir: Path) -> None:
    """Everything after the run: save, read the page, move a widget, take the screenshot."""
    nb, result = tab.page, tab.result
    result.seconds["run"] = time.monotonic() - tab.started
    t = time.monotonic()
    saved = nb.save()
    result.problems += find_problems(saved, nb.read_cells())
    result.seconds["check"], t = time.monotonic() - t, time.monotonic()
    result.widget = nb.move_first_widget()
    if result.widget is not None:
        kind = result.widget.kind
        if kind == "stuck":
            result.problems.append("widgets drive outputs here, but none has a control with a second value to move to")
        elif not result.widget.changed:
            result.problems.append(f"moving the first {kind} widget did not change the output it drives")
        result.problems += [f"after moving the {kind}: {p}" for p in find_problems(saved, nb.read_cells())]
    result.seconds["widget"], t = time.monotonic() - t, time.monotonic()
    result.screenshot = nb.screenshot(screenshots_dir)
    result.seconds["screenshot"] = time.monotonic() - t


def _driver_failure(result: NotebookResult, what: str, tab: _Tab | None, screenshots_dir: Path) -> None:
    result.problems.append(f"{what}: {traceback.format_exc(limit=3).strip()[-1500:]}")
    if tab is not None and result.screenshot is None:
        try:  # what the page showed when it went wrong
            result.screenshot = tab.page.screenshot(screenshots_dir)
        except Exception:  # noqa: BLE001 - the page may be gone; the problem is already recorded
            pass


def run_workbook(browser: Browser, lab: Lab, names: list[str], screenshots_dir: Path, tabs: int | None = None,
                 run_timeout_s: float = RUN_TIMEOUT_S) -> dict[str, NotebookResult]:
    """Run ``names`` (notebook paths relative to the served folder), ``tabs`` at a time; results by name."""
    tabs = tabs or default_tabs()
    waiting, running, results = list(names), [], {}
    while waiting or running:
        while waiting and len(running) < tabs:
            name = waiting.pop(0)
            try:
                running.append(_Tab(browser, lab, name))
            except Exception:  # noqa: BLE001 - recorded as this notebook's problem
                results[name] = NotebookResult(name)
                _driver_failure(results[name], "could not open it and start Run All", None, screenshots_dir)
                lab.shut_down_kernels(name)
        for tab in list(running):
            try:
                done = tab.page.run_finished()
                overdue = time.monotonic() - tab.started > run_timeout_s
                if not (done or overdue):
                    continue
                if overdue and not done:
                    tab.result.problems.append(f"still running after {run_timeout_s:.0f} s (prompts show [*])")
                    tab.result.screenshot = tab.page.screenshot(screenshots_dir)
                else:
                    _finish(tab, screenshots_dir)
            except Exception:  # noqa: BLE001 - recorded as this notebook's problem
                _driver_failure(tab.result, "the browser driver failed", tab, screenshots_dir)
            running.remove(tab)
            results[tab.result.name] = tab.result
            try:
                tab.page.close()
            finally:
                lab.shut_down_kernels(tab.result.name)  # frees the kernel's memory and threads for the next
        time.sleep(POLL_S)
    return results
