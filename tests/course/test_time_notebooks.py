"""scripts/time_notebooks.py runs a notebook to the end in a fresh kernel, including a cell that displays widgets
(nbconvert's cell-by-cell execution could wait forever on such a cell: jupyter/nbclient#312), times its cells and
reads its printed verdicts back for the audit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import time_notebooks  # noqa: E402


def code(source: str) -> dict:  # type: ignore[type-arg]
    return {"cell_type": "code", "execution_count": None, "id": f"c{abs(hash(source)) % 10**8}", "metadata": {},
            "outputs": [], "source": source}


def test_a_widget_notebook_runs_to_the_end_and_its_verdicts_are_audited(tmp_path: Path) -> None:
    cells = [
        code("import ipywidgets as widgets\nfrom IPython.display import display\n"
             "slider = widgets.IntSlider(value=3, description='step')\n"
             "view = widgets.interactive_output(lambda step: print('step', step), {'step': slider})\n"
             "display(widgets.VBox([widgets.HTML('<b>pick</b>'), slider, view]))"),
        code("print('[holds] A beats B: A 2.0 vs B 1.0 tok/s (median of 2 rounds: 2.00x in the claim\\'s favour; "
             "rounds 1.90x-2.10x)')\n"
             "print('[holds] C beats D: C 1.0 vs D 2.0 tok/s (median of 2 rounds: 0.50x in the claim\\'s favour; "
             "rounds 0.45x-0.55x)')"),
    ]
    nb = {"cells": cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                      "language": "python"}}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "99_widgets.ipynb"
    path.write_text(json.dumps(nb))
    r = time_notebooks.time_notebook(path, smoke=True, outdir=tmp_path / "out", timeout_s=120)
    assert r.ok and r.notebook == "99_widgets" and not r.busy_neighbour
    assert len(r.verdicts) == 2 and r.verdicts[0].startswith("[holds] A beats B")
    assert len(r.verdict_problems) == 1 and "C beats D" in r.verdict_problems[0]  # [holds] at 0.50x: caught
    assert {i for i, _ in time_notebooks.cell_seconds(tmp_path / "out" / "99_widgets.ipynb")} == {0, 1}
