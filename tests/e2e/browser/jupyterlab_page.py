"""Driving one notebook in JupyterLab as a learner does, and reading back what the page shows.

``NotebookPage`` opens a notebook in its own JupyterLab workspace, runs every cell from the Run menu,
waits until the kernel is idle with no cell queued, saves (the served copy), reads the rendered page,
moves a widget's control, and takes a screenshot of the whole notebook. ``notebook_problems.find_problems``
compares what the kernel produced (the saved notebook) with what the browser rendered, and names every cell
that went wrong.
"""

from __future__ import annotations

import io
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image
from playwright.sync_api import Browser, BrowserContext, Page

from .browser_services import Lab
from .notebook_problems import CellView

RUN_TIMEOUT_S = 480.0  # all cells of one notebook in smoke mode; generous for 2 shared cores
WIDGET_TIMEOUT_S = 120.0  # a moved control until the output it drives has redrawn
SCREENSHOT_CHUNK_PX = 4000  # the tallest viewport used to capture a notebook (parts are stitched)
VIEWPORT = {"width": 1400, "height": 1000}


# One pass over the rendered notebook: per cell, its prompt, its top-level outputs, every image and
# every stderr block inside its output area (nested widget outputs included).
READ_CELLS_JS = """
() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell')].map(cell => {
  const area = cell.querySelector('.jp-Cell-outputArea');
  const prompt = cell.querySelector('.jp-InputPrompt');
  const top = area ? [...area.querySelectorAll(':scope > .jp-OutputArea-child > .jp-OutputArea-output')] : [];
  return {
    code: cell.classList.contains('jp-CodeCell'),
    prompt: prompt ? prompt.textContent.trim() : '',
    outputs: top.map(o => {
      const view = o.querySelector(':scope > .jupyter-widgets');
      const box = view ? view.getBoundingClientRect() : null;
      return {mime: o.getAttribute('data-mime-type') || '', text: o.textContent.slice(0, 4000),
              widget_view: !!view, widget_area: box ? box.width * box.height : 0,
              images: [...o.querySelectorAll('img')].filter(i => !i.closest('.widget-output')).length};
    }),
    images: area ? [...area.querySelectorAll('img')].map(i => ({
      loaded: i.complete && i.naturalWidth > 0, in_widget: !!i.closest('.widget-output')})) : [],
    stderr: area ? [...area.querySelectorAll('[data-mime-type="application/vnd.jupyter.stderr"]')]
                     .map(e => e.textContent.slice(0, 4000)) : [],
    text: area ? area.textContent : '',
  };
})
"""

# The first widget that drives an output (a widget view holding an Output widget) and, in it, the first
# control that can move: a slider with a range, a dropdown or toggle group with a second option, a checkbox.
FIND_CONTROL_JS = """
() => {
  const views = [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell-outputArea ' +
                                              '> .jp-OutputArea-child > .jp-OutputArea-output > .jupyter-widgets')];
  const kinds = [['slider', '.widget-slider .noUi-handle',
                  h => h.getAttribute('aria-valuemin') !== h.getAttribute('aria-valuemax')],
                 ['dropdown', '.widget-dropdown select', s => s.options.length > 1],
                 ['toggle', '.widget-toggle-buttons', g => g.querySelectorAll('button:not(.mod-active)').length > 0],
                 ['checkbox', '.widget-checkbox input[type=checkbox]', c => !c.disabled]];
  let drivers = 0;
  for (const view of views) {
    const all = [...view.querySelectorAll(kinds.map(k => k[1]).join(', '))];
    if (!view.querySelector('.widget-output') || !all.length) continue;
    drivers += 1;
    for (const control of all) {
      const [kind, , movable] = kinds.find(k => control.matches(k[1]));
      if (!movable(control)) continue;
      view.setAttribute('data-browser-test', 'interactive');
      control.setAttribute('data-browser-test', 'control');
      return kind;
    }
  }
  return drivers ? 'stuck' : null;
}
"""

# What the Output widgets of a widget view show: their images' data and their text.
OUTPUT_SIGNATURE_JS = """
view => [...view.querySelectorAll('.widget-output')].map(out =>
  [...out.querySelectorAll('img')].map(i => i.src).join('|') + '\\n' + out.textContent).join('\\n---\\n')
"""


@dataclass
class WidgetMove:
    """A moved control and what the Output widget it drives showed before and after."""

    kind: str
    before: str
    after: str
    changed: bool = field(init=False)

    def __post_init__(self) -> None:
        self.changed = self.before != self.after


class NotebookPage:
    """One notebook open in JupyterLab (served by ``lab``), in a browser context and workspace of its own."""

    def __init__(self, browser: Browser, lab: Lab, name: str) -> None:
        self.name, self.path, self._calm = name, lab.root_dir / name, 0
        self.context: BrowserContext = browser.new_context(viewport=VIEWPORT)
        self.page: Page = self.context.new_page()
        workspace = re.sub(r"\W", "-", Path(name).stem)
        self.page.goto(f"{lab.url}/lab/workspaces/{workspace}/tree/{name}?reset&token={lab.token}")
        self.page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").first.wait_for(timeout=120_000)
        self.wait_for_kernel_idle(timeout_s=120)  # the kernel has started

    def _status(self) -> str:
        return self.page.evaluate("() => document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) "
                                  ".jp-Notebook-ExecutionIndicator')?.getAttribute('data-status') ?? ''")

    def _prompts(self) -> list[str]:
        return self.page.evaluate("() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) "
                                  ".jp-CodeCell .jp-InputPrompt')].map(e => e.textContent.trim())")

    def _idle(self) -> bool:
        return self._status() == "idle" and not any("*" in p for p in self._prompts())

    def wait_for_kernel_idle(self, timeout_s: float) -> None:
        """Until the kernel is idle and no cell is queued or running ([*]), three polls in a row."""
        deadline, calm = time.monotonic() + timeout_s, 0
        while calm < 3:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: kernel still {self._status()!r} after {timeout_s:.0f} s; "
                                   f"prompts {self._prompts()}")
            calm = calm + 1 if self._idle() else 0
            time.sleep(0.5)

    def menu(self, top: str, item: str) -> None:
        self.page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{re.escape(top)}$")).click()
        self.page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")).click()

    def start_run_all(self) -> None:
        """Run > Run All Cells; returns once the first cell is queued (its prompt shows [*])."""
        self.menu("Run", "Run All Cells")
        self.page.wait_for_function("() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) "
                                    ".jp-CodeCell .jp-InputPrompt')].some(e => /\\[[*\\d]+\\]/.test(e.textContent))",
                                    timeout=30_000)

    def run_finished(self) -> bool:
        """Does not wait: True once the kernel was idle with no cell queued or running at three calls in a row."""
        self._calm = self._calm + 1 if self._idle() else 0
        return self._calm >= 3

    def run_all(self, timeout_s: float = RUN_TIMEOUT_S) -> None:
        """Run All Cells, then wait for the kernel to go idle."""
        self.start_run_all()
        self.wait_for_kernel_idle(timeout_s)

    def save(self, timeout_s: float = 60.0) -> dict[str, object]:
        """File > Save Notebook (the served copy), then the notebook as saved, once every output is in it."""
        shown_counts = [p for p in self._prompts() if re.fullmatch(r"\[\d+\]:", p)]
        self.menu("File", "Save Notebook")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                saved = json.loads(self.path.read_text())
                counts = [c for c in saved["cells"] if c["cell_type"] == "code" and c.get("execution_count")]
                if len(counts) >= len(shown_counts):
                    return saved
            except (json.JSONDecodeError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: not saved with its outputs within {timeout_s:.0f} s")
            time.sleep(0.5)

    def read_cells(self) -> list[CellView]:
        return [CellView(**c) for c in self.page.evaluate(READ_CELLS_JS)]

    def move_first_widget(self, timeout_s: float = WIDGET_TIMEOUT_S) -> WidgetMove | None:
        """Move the first movable control of the first widget that drives an Output widget, as a learner
        would (arrow key on a slider, another option in a dropdown or toggle group, a click on a checkbox);
        None when the notebook has no such widget; kind "stuck" when none of its controls can move."""
        kind = self.page.evaluate(FIND_CONTROL_JS)
        if kind is None:
            return None
        if kind == "stuck":  # widgets drive outputs, but no control offers a second value
            return WidgetMove(kind, "", "")
        view = self.page.locator('[data-browser-test="interactive"]')
        control = self.page.locator('[data-browser-test="control"]')
        control.scroll_into_view_if_needed()
        before = view.evaluate(OUTPUT_SIGNATURE_JS)
        if kind == "slider":
            at_max = control.get_attribute("aria-valuenow") == control.get_attribute("aria-valuemax")
            control.focus()
            control.press("ArrowLeft" if at_max else "ArrowRight")
        elif kind == "dropdown":
            following = (control.evaluate("s => s.selectedIndex") + 1) % control.locator("option").count()
            control.select_option(index=following)
        elif kind == "toggle":
            control.locator("button:not(.mod-active)").first.click()
        else:
            control.click()
        deadline = time.monotonic() + timeout_s
        while view.evaluate(OUTPUT_SIGNATURE_JS) == before and time.monotonic() < deadline:
            time.sleep(0.5)
        self.wait_for_kernel_idle(timeout_s)  # the callback has finished drawing
        return WidgetMove(kind, before, view.evaluate(OUTPUT_SIGNATURE_JS))

    def screenshot(self, folder: Path) -> Path:
        """The whole notebook (its scrolled area, top to last cell) as one PNG, ``folder/<notebook>.png``.

        The page is scrolled a viewport at a time and the parts are stitched, so the image is the
        notebook as a learner scrolls through it, outputs and widgets included.
        """
        scroller = self.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer").first
        measure = """e => { const cells = e.querySelectorAll('.jp-Cell');
            const last = cells[cells.length - 1].getBoundingClientRect(), box = e.getBoundingClientRect();
            return {content: Math.ceil(last.bottom - box.top + e.scrollTop) + 16, view: e.clientHeight,
                    width: e.clientWidth}; }"""
        size = scroller.evaluate(measure)
        # a taller viewport means fewer parts; Chromium caps one capture's size, hence chunks
        self.page.set_viewport_size({"width": VIEWPORT["width"], "height": VIEWPORT["height"] - size["view"]
                                     + min(size["content"], SCREENSHOT_CHUNK_PX)})
        size = scroller.evaluate(measure)
        box = scroller.bounding_box()
        assert box is not None, "the notebook is not on the page"
        width = size["width"]  # without the scroll bar
        sheet = Image.new("RGB", (width, size["content"]), "white")
        offset = 0
        while True:
            top = scroller.evaluate("(e, y) => { e.scrollTop = y; return e.scrollTop; }", offset)
            self.page.wait_for_timeout(200)  # let the scrolled part paint
            part = Image.open(io.BytesIO(self.page.screenshot(
                clip={"x": box["x"], "y": box["y"], "width": width, "height": size["view"]})))
            sheet.paste(part, (0, top))  # the last scroll may stop short: paste where it stopped
            if top < offset or top + size["view"] >= size["content"]:
                break  # the bottom is in this part
            offset = top + size["view"]
        self.page.set_viewport_size(VIEWPORT)
        path = folder / f"{Path(self.name).stem}.png"
        sheet.save(path)
        return path

    def close(self) -> None:
        self.context.close()
