"""Notebooks 02-10: each Build task has collapsed hint cells for the three levels of its staged hints (no recipe in
the task text), and each notebook records a prediction before its headline measurement and prints it in a verdict."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from labkit.course import TASKS

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
CHAPTERS = [f"{n:02d}" for n in range(2, 11)]


def cells(number: str) -> list[dict]:
    (path,) = NOTEBOOKS.glob(f"{number}_*.ipynb")
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def source(cell: dict) -> str:
    return "".join(cell["source"])


@pytest.mark.parametrize("task_id", [t for t, task in TASKS.items() if task.is_build and t[:2] in CHAPTERS])
def test_a_build_task_has_collapsed_hint_cells_for_each_level(task_id: str) -> None:
    hint_cells = {level: cell for cell in cells(task_id[:2]) for level in (1, 2, 3)
                  if re.search(rf"show_hint\({task_id!r}, {level}\)", source(cell))}
    assert sorted(hint_cells) == [1, 2, 3], f"{task_id}: hint cells for levels {sorted(hint_cells)}"
    for cell in hint_cells.values():
        assert cell["cell_type"] == "code" and cell["metadata"].get("jupyter", {}).get("outputs_hidden") is True


@pytest.mark.parametrize("number", CHAPTERS)
def test_no_task_text_hands_over_the_code_in_a_details_block(number: str) -> None:
    texts = [source(c) for c in cells(number) if c["cell_type"] == "markdown" and re.search(r"#+\s*Task \d", source(c))]
    assert texts and not any("<details>" in t for t in texts)


@pytest.mark.parametrize("number", CHAPTERS)
def test_a_prediction_is_recorded_before_the_headline_measurement_and_printed(number: str) -> None:
    sources = [source(c) for c in cells(number) if c["cell_type"] == "code"]
    recorded = [i for i, s in enumerate(sources) if re.search(r"^my_prediction = None", s, re.MULTILINE)]
    used = [i for i, s in enumerate(sources) if "prediction=my_prediction" in s]
    assert len(recorded) == 1 and used and recorded[0] < used[0], (recorded, used)
    assert "Predict, then measure" in sources[recorded[0]]
