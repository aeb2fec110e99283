"""Finding what went wrong in a notebook run: the saved notebook (what the kernel produced) against the page.

``find_problems`` names every cell that went wrong:

* an error output, or a traceback shown anywhere (also inside a widget's output, where a callback's
  exception lands without failing the cell);
* a code cell that never ran;
* a plot that did not become an image: a cell that calls ``plt.show()`` without a loaded ``<img>``,
  matplotlib's text stand-in ``<Figure size ... with N Axes>``, an image output the page does not
  show, or a broken image;
* a widget that did not render: "Loading widget..." / "Error displaying widget", or a widget output
  with no widget view in it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

IMAGE_MIMES = ("image/png", "image/jpeg", "image/svg+xml", "image/gif")
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
# An exception as IPython shows it: the traceback header, "Cell In[3], line 1", or "ValueError: ...".
TRACEBACK = re.compile(r"Traceback \(most recent call last\)|^\s*Cell In\[\d+\], line \d+"
                       r"|^\s*[A-Z]\w*(Error|Exception|Interrupt)(: |\s*$)", re.MULTILINE)
FIGURE_AS_TEXT = re.compile(r"<Figure size \d+x\d+ with \d+ Axes>")
WIDGET_FAILURES = ("Loading widget...", "Error displaying widget")


@dataclass
class CellView:
    """What the browser shows for one cell (see jupyterlab_page.READ_CELLS_JS)."""

    code: bool
    prompt: str
    outputs: list[dict[str, object]]
    images: list[dict[str, bool]]
    stderr: list[str]
    text: str


def code_cell_ran(cell: dict[str, object]) -> bool:
    return cell["cell_type"] != "code" or not "".join(cell["source"]).strip() or cell.get("execution_count") is not None


def find_problems(saved: dict[str, object], cells: list[CellView]) -> list[str]:
    """Every way the run went wrong, one line each naming the cell (its index in the notebook)."""
    nb_cells: list[dict[str, object]] = saved["cells"]  # type: ignore[assignment]
    if len(nb_cells) != len(cells):
        return [f"the page shows {len(cells)} cells, the saved notebook has {len(nb_cells)}"]
    problems: list[str] = []
    for i, (cell, view) in enumerate(zip(nb_cells, cells)):
        where = f"cell {i}"
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        outputs: list[dict[str, object]] = cell.get("outputs", [])  # type: ignore[assignment]
        if not code_cell_ran(cell):
            problems.append(f"{where} did not run (prompt {view.prompt!r})")
        for out in outputs:
            if out["output_type"] == "error":
                problems.append(f"{where} raised {out['ename']}: {out['evalue']}")
        for text in view.stderr:
            if TRACEBACK.search(text):
                problems.append(f"{where} shows an error: {text.strip()[:600]}")
        if FIGURE_AS_TEXT.search(view.text):
            problems.append(f"{where} shows a figure as text, not an image: {FIGURE_AS_TEXT.search(view.text)[0]}")
        for failure in WIDGET_FAILURES:
            if failure in view.text:
                problems.append(f"{where} shows {failure!r}")
        broken = [img for img in view.images if not img["loaded"]]
        if broken:
            problems.append(f"{where} has {len(broken)} image(s) that did not load")
        if len(view.outputs) != len(outputs):
            problems.append(f"{where}: the page shows {len(view.outputs)} outputs, the kernel produced {len(outputs)}")
            continue
        for j, (out, shown) in enumerate(zip(outputs, view.outputs)):
            data: dict[str, object] = out.get("data", {})  # type: ignore[assignment]
            if WIDGET_MIME in data and data[WIDGET_MIME].get("model_id") and not (  # type: ignore[union-attr]
                    shown["widget_view"] and shown["widget_area"] > 0):  # type: ignore[operator]
                problems.append(f"{where}, output {j}: widget not rendered (page shows {shown['text'][:80]!r})")
            elif any(m in data for m in IMAGE_MIMES) and not shown["images"]:
                problems.append(f"{where}, output {j}: image output not shown as an image")
        if "plt.show(" in source and not any(img["loaded"] for img in view.images):
            problems.append(f"{where} calls plt.show() but shows no plot image")
    return problems
