"""Every notebook, run as a learner runs it: JupyterLab in Chromium, Run All, then read the page.

For each notebook (``sorted(notebooks/*.ipynb)``, so new chapters are picked up): every cell ran, no cell
shows an error, every plot rendered as an image, every widget rendered; the first widget that drives an
output is moved and that output must change. The notebooks run a few tabs at a time (``workbook_runner``);
each test reports one notebook. Screenshots of each run notebook go to ``screenshots/`` (gitignored).
A planted notebook proves the checks catch each failure they look for.

Run alone:  ``.venv/bin/python -m pytest tests/e2e/browser -o addopts="" -p no:cacheprovider``
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import nbformat
import pytest
from playwright.sync_api import Browser

from .browser_services import NOTEBOOKS_DIR, SCREENSHOTS_DIR, Lab, default_tabs
from .jupyterlab_page import NotebookPage
from .notebook_problems import find_problems
from .workbook_runner import BrowserReport, NotebookResult, run_workbook

NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
# Generous: the first test waits for every selected notebook (and may install Chromium first).
WORKBOOK_TIMEOUT_S = 3600


@pytest.fixture(scope="module")
def workbook(request: pytest.FixtureRequest, lab: Lab, browser: Browser, browser_report: BrowserReport
             ) -> dict[str, NotebookResult]:
    """Runs every notebook selected in this session (``-k`` narrows it) once, side by side in a few tabs."""
    names = [item.callspec.params["path"].name for item in request.session.items
             if getattr(item, "module", None) is request.module  # nbval's notebook cells have no module
             and item.originalname == "test_notebook_runs_in_jupyterlab"]
    committed = {name: (NOTEBOOKS_DIR / name).read_bytes() for name in names}
    start = time.monotonic()
    results = run_workbook(browser, lab, names, SCREENSHOTS_DIR)
    browser_report.lines.append(f"{len(names)} notebook(s), {default_tabs()} tab(s) at a time, "
                                f"{time.monotonic() - start:.0f} s in all")
    for name, result in results.items():
        if (NOTEBOOKS_DIR / name).read_bytes() != committed[name]:
            result.problems.append("the committed notebook changed: the browser must only touch the served copy")
        if result.screenshot is not None:
            browser_report.screenshots.append(result.screenshot)
        problems = f"; {len(result.problems)} problem(s)" if result.problems else ""
        browser_report.lines.append(result.summary() + problems)
    return results


@pytest.mark.timeout(WORKBOOK_TIMEOUT_S)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_in_jupyterlab(path: Path, workbook: dict[str, NotebookResult]) -> None:
    result = workbook[path.name]
    assert not result.problems, (f"{path.name}: {len(result.problems)} problem(s) in JupyterLab "
                                 f"(screenshot: {result.screenshot}):\n  " + "\n  ".join(result.problems))


# --- the checks catch what they look for -------------------------------------------------------------

PLANTED = [
    "import ipywidgets as widgets\nimport matplotlib.pyplot as plt\nfrom IPython.display import display",
    # 1: a working interactive plot (a dropdown with one option first: it cannot move, so the slider is moved)
    "def draw(n, style):\n    plt.plot(range(n + 2), style)\n    plt.title(f'n = {n}')\n    plt.show()\n"
    "s = widgets.IntSlider(value=3, min=0, max=9, continuous_update=False)\n"
    "d = widgets.Dropdown(options=['-'])\n"
    "display(widgets.VBox([d, s, widgets.interactive_output(draw, {'n': s, 'style': d})]))",
    # 2: a callback that raises inside its Output widget (the cell itself succeeds)
    "def broken(n):\n    raise ValueError(f'planted callback failure {n}')\n"
    "t = widgets.IntSlider(value=1, continuous_update=False)\n"
    "display(widgets.VBox([t, widgets.interactive_output(broken, {'n': t})]))",
    # 3: a widget output whose model does not exist
    "display({'application/vnd.jupyter.widget-view+json': {'model_id': 'f' * 32, 'version_major': 2, "
    "'version_minor': 0}}, raw=True)",
    # 4: plt.show() without a rendered image, and a figure shown as text
    "import matplotlib\nmatplotlib.use('agg')\nplt.plot([1, 2])\nplt.show()\nprint(repr(plt.gcf()))\n"
    "plt.close('all')\nmatplotlib.use('module://matplotlib_inline.backend_inline')  # cell 1's slider draws again",
    # 5: an error; Run All stops here
    "raise RuntimeError('planted cell failure')",
    # 6: never runs
    "print('unreachable')",
]


@contextmanager
def served_page(lab: Lab, browser: Browser, name: str, notebook: nbformat.NotebookNode) -> Iterator[NotebookPage]:
    """``notebook`` written to the served copy only, as ``name``, open in a page of its own."""
    nbformat.write(notebook, lab.root_dir / name)
    page = NotebookPage(browser, lab, name)
    try:
        yield page
    finally:
        page.close()
        lab.shut_down_kernels(name)


@pytest.fixture
def planted_page(lab: Lab, browser: Browser) -> Iterator[NotebookPage]:
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in PLANTED])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    with served_page(lab, browser, "zz_planted_failures.ipynb", notebook) as page:
        yield page


def test_checks_catch_planted_failures(planted_page: NotebookPage) -> None:
    planted_page.run_all()
    saved = planted_page.save()
    problems = find_problems(saved, planted_page.read_cells())

    def about(cell: int, text: str) -> bool:
        return any(p.startswith(f"cell {cell}") and text in p for p in problems)

    assert not any(p.startswith(("cell 0", "cell 1")) for p in problems), problems  # working cells pass
    assert about(2, "shows an error") and about(2, "planted callback failure"), problems
    assert about(3, "Loading widget...") or about(3, "Error displaying widget"), problems
    assert about(3, "widget not rendered"), problems
    assert about(4, "calls plt.show() but shows no plot image"), problems
    assert about(4, "shows a figure as text"), problems
    assert about(5, "raised RuntimeError: planted cell failure"), problems
    assert about(6, "did not run"), problems

    move = planted_page.move_first_widget()
    assert move is not None and move.kind == "slider" and move.changed, move


# --- a learner's wrong task: the notebook still runs, says what is wrong, and goes on with labkit's ------------

WRONG_TASK_NOTEBOOK = "03_kv_cache.ipynb"
# A typical mistake: the new K/V are returned but never written into the cache, so decode steps forget the prompt.
WRONG_WRITE_KV = "def write_kv(cache, new, start):\n    return new  # deliberately wrong: nothing is written\n"


@pytest.fixture
def wrong_task_page(lab: Lab, browser: Browser) -> Iterator[NotebookPage]:
    notebook = nbformat.read(NOTEBOOKS_DIR / WRONG_TASK_NOTEBOOK, as_version=4)
    stubs = [c for c in notebook.cells if c.cell_type == "code" and "def write_kv(" in c.source
             and "NotImplementedError" in c.source]
    assert len(stubs) == 1, f"{WRONG_TASK_NOTEBOOK}: expected one write_kv stub cell, found {len(stubs)}"
    stubs[0].source = WRONG_WRITE_KV
    with served_page(lab, browser, "zz_wrong_task.ipynb", notebook) as page:
        yield page


def test_a_wrong_task_runs_to_the_end_says_why_and_uses_the_reference(wrong_task_page: NotebookPage) -> None:
    wrong_task_page.run_all()
    saved = wrong_task_page.save()
    views = wrong_task_page.read_cells()
    assert find_problems(saved, views) == []  # every cell ran, no error: the notebook went on
    shown = [v.text for v in views if v.code and "write_kv" in v.text and "failed" in v.text]
    assert shown, "no check cell shows the task's failure"
    message = shown[0]
    assert "Task 1 (write_kv)" in message and "check(s) failed" in message, message
    assert "Think about:" in message and "show_hint('03.write_kv', 2)" in message, message  # what to look at
    assert "transpose(1, 2)" not in message, message  # the code-level hint only when asked
    assert "uses labkit's reference" in message and "write_kv" in message, message  # and what runs instead
