"""The entry documents' task regions (README, learner path, instructor guide) agree with labkit.course.TASKS."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from labkit.course import TASKS, task_label

ROOT = Path(__file__).resolve().parents[2]


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_learner_docs", ROOT / "scripts" / "make_learner_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_learner_docs"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


docs = load_script()
BOOKS = docs.notebooks()


def region(path: Path, name: str) -> str:
    text = path.read_text(encoding="utf-8")
    return text.split(f"<!-- BEGIN GENERATED: {name} -->", 1)[1].split(f"<!-- END GENERATED: {name} -->", 1)[0]


@pytest.mark.parametrize("path", list(docs.REGIONS), ids=lambda p: p.name)
def test_the_generated_regions_are_up_to_date(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert docs.render(path, text, BOOKS) == text, f"{path.name} is stale: run make learner-docs"


def test_every_task_and_notebook_is_on_the_readme_path_and_in_the_tables() -> None:
    path = region(docs.README, "tasks-path")
    table = region(docs.LEARNER_PATH, "tasks-table")
    for task in TASKS.values():
        assert f"`{task.id}`" in path and f"`{task.id}`" in table, task.id
        assert f"{task_label(task.id).split(' (')[0]}: {task.title} (`{task.id}`)" in table
    numbers = sorted({t.notebook[:2] for t in TASKS.values()} | {p.stem[:2] for p in docs.NOTEBOOKS.glob("*.ipynb")})
    for name in ("tasks-times", "tasks-short", "tasks-check-cells"):
        rows = re.findall(r"^\| (\d\d) \|", region(docs.LEARNER_PATH, name), re.MULTILINE)
        assert rows == numbers, name
    assert f"00 to {numbers[-1]}" in path
    agenda = region(docs.INSTRUCTOR_GUIDE, "tasks-agenda")
    assert all(f"**{n}**" in agenda for n in numbers)


def test_the_times_add_up() -> None:
    rows = re.findall(r"^\| (\d\d|all) \| [^|]+ \| ([^|]+) \| [^|]+ \| ([^|]+) \| ([^|]+) \|$",
                      region(docs.LEARNER_PATH, "tasks-times"), re.MULTILINE)

    def minutes(text: str) -> int:
        h = re.match(r"\s*(?:(\d+) h )?(\d+) min\s*$", text)
        assert h, text
        return int(h[1] or 0) * 60 + int(h[2])

    body, (_, *total) = rows[:-1], rows[-1]
    assert rows[-1][0] == "all"
    for number, reading, tasks, in_all in body:
        assert minutes(reading) + minutes(tasks) == minutes(in_all), number
        assert minutes(tasks) == sum(t.minutes for t in TASKS.values() if t.notebook[:2] == number)
    for column in range(3):
        assert sum(minutes(row[column + 1]) for row in body) == minutes(total[column])


def test_a_task_registered_later_appears_without_editing_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    new = dataclasses.replace(TASKS["08.schedule_running"], id="16.demo", notebook="16_demo", title="a demo task")
    monkeypatch.setitem(TASKS, new.id, new)
    books = docs.notebooks()
    assert books[-1].stem == "16_demo"
    assert "`16.demo`" in docs.path_region(books) and "00 to 16" in docs.path_region(books)
    assert "**16** demo" in docs.agenda_region(books) and "| 16 |" in docs.times_region(books)


def test_a_document_without_its_region_is_an_error() -> None:
    with pytest.raises(docs.RegionError, match="tasks-table"):
        docs.with_region("no region here", "tasks-table", "x", docs.LEARNER_PATH)


def test_the_readme_states_the_measured_install_size() -> None:
    assert "1.8 GB" not in docs.README.read_text(encoding="utf-8")
    assert "measured by `scripts/measure_install_size.py`" in region(docs.README, "tasks-install-size")


def test_notebook_10_is_not_the_last_chapter() -> None:
    text = (ROOT / "notebooks" / "10_profiling_host_overhead.ipynb").read_text(encoding="utf-8").lower()
    assert "last chapter" not in text and "last notebook" not in text
