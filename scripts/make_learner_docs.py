"""Generate the entry documents' task regions from ``labkit.course.TASKS`` and the notebooks on disk.

    .venv/bin/python scripts/make_learner_docs.py           # (re)write the regions (make learner-docs)
    .venv/bin/python scripts/make_learner_docs.py --check   # exit 1 if a region is out of date

Every region is ``<!-- BEGIN GENERATED: tasks-NAME -->`` ... ``<!-- END GENERATED: tasks-NAME -->``; the text around
them is written by hand. README.md: the path through every notebook with its tasks (``tasks-path``) and the installed
size (``tasks-install-size``, from docs/install_size.json, written by ``scripts/measure_install_size.py``).
docs/learner_path.md: the task table (``tasks-table``), each notebook's time (``tasks-times``), the short path
(``tasks-short``) and the check-cell table (``tasks-check-cells``). docs/instructor_guide.md: the task table and a
multi-day agenda through every notebook (``tasks-agenda``). A notebook registered in TASKS (chapters 14, 15, ...)
appears everywhere without an edit here. tests/course/test_learner_docs.py fails when a region is stale.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, not installed

from labkit.course.tasks import TASKS, Task  # noqa: E402

NOTEBOOKS = ROOT / "notebooks"
README, LEARNER_PATH, INSTRUCTOR_GUIDE = ROOT / "README.md", ROOT / "docs" / "learner_path.md", \
    ROOT / "docs" / "instructor_guide.md"
INSTALL_SIZE = ROOT / "docs" / "install_size.json"

# Minutes to run, read and discuss a notebook, its tasks aside (they have their own minutes in TASKS): a planning
# figure for a learner on a 2-core laptop (docs/learner_path.md has the measured machine times).
READING_MINUTES = {"00": 15, "01": 20, "02": 20, "03": 25, "04": 30, "05": 20, "06": 30, "07": 30, "08": 25,
                   "09": 35, "10": 30, "11": 30, "12": 35, "13": 30}
DEFAULT_READING_MINUTES = 30
# The core thread for a learner short on time: one request, the KV cache, the roofline of a step, continuous
# batching and the token budget. The others deepen it and can be read later.
CORE = ("00", "01", "03", "04", "07", "08")
SESSION_MINUTES = 210  # an agenda's half day: 3.5 hours of work, breaks aside


@dataclass(frozen=True)
class Notebook:
    """One notebook of the workbook: its number, file stem, title and tasks (in TASKS order)."""

    number: str
    stem: str
    title: str
    tasks: tuple[Task, ...]

    @property
    def task_minutes(self) -> int:
        return sum(t.minutes for t in self.tasks)

    @property
    def reading_minutes(self) -> int:
        return READING_MINUTES.get(self.number, DEFAULT_READING_MINUTES)

    @property
    def total_minutes(self) -> int:
        return self.reading_minutes + self.task_minutes

    @property
    def link(self) -> str:
        return f"[{self.stem[3:]}](notebooks/{self.stem}.ipynb)"


def title_of(path: Path) -> str:
    """The notebook's first heading without its number ("Setup and hardware: how fast ..."), or its name."""
    if path.is_file():
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] == "markdown":
                first = "".join(cell["source"]).strip().splitlines()[0]
                return re.sub(r"^#+\s*\d+\s*[·:.-]?\s*", "", first).strip()
    return path.stem[3:].replace("_", " ").capitalize()


def notebooks(tasks: dict[str, Task] | None = None) -> list[Notebook]:
    """Every notebook on disk or in TASKS, in order, with its tasks."""
    tasks = TASKS if tasks is None else tasks
    stems = sorted({p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")} | {t.notebook for t in tasks.values()})
    return [Notebook(s[:2], s, title_of(NOTEBOOKS / f"{s}.ipynb"),
                     tuple(t for t in tasks.values() if t.notebook == s)) for s in stems]


def number_of(task: Task, book: Notebook) -> int:
    return book.tasks.index(task) + 1


def hours(minutes: int) -> str:
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


def task_name(task: Task, book: Notebook) -> str:
    return f"Task {number_of(task, book)}: {task.title} (`{task.id}`)"


# ---- the regions ----


def path_region(books: list[Notebook]) -> str:
    """README: every notebook in order, its Build tasks (run inside the engine) and its other tasks."""
    lines = [f"Work through the notebooks in order, {books[0].number} to {books[-1].number}. Each one's **Build** "
             "tasks run inside the real engine; the others teach one formula or rule.", ""]
    for b in books:
        build = [task_name(t, b) for t in b.tasks if t.is_build]
        other = [task_name(t, b) for t in b.tasks if not t.is_build]
        parts = ([f"Build: {'; '.join(build)}"] if build else []) + ([f"exercise: {'; '.join(other)}"] if other
                                                                     else [])
        title = b.title if b.title.endswith(("?", ".", "!")) else f"{b.title}."
        lines.append(f"- **{b.number}** {b.link} — {title} {'. '.join(parts) or 'No task'} "
                     f"(about {hours(b.total_minutes)}).")
    total = sum(b.total_minutes for b in books)
    num_build = sum(t.is_build for b in books for t in b.tasks)
    lines += ["", f"{sum(len(b.tasks) for b in books)} tasks, {num_build} of them Build tasks; about {hours(total)} "
              "in all with reading (per notebook: [docs/learner_path.md](docs/learner_path.md#how-long-each-notebook-"
              "takes))."]
    return "\n".join(lines)


def task_table(books: list[Notebook]) -> str:
    """Every task with its expected time and the mistakes its checker is tested to catch (for the guides)."""
    rows = ["| notebook | task | runs inside the engine | expected time | mistakes the checker catches |",
            "|---|---|---|---:|---|"]
    for b in books:
        for t in b.tasks:
            caught = "; ".join(t.catches) or "—"
            rows.append(f"| {b.number} | {task_name(t, b)} | {t.runs_inside or '— (checked on its own)'} | "
                        f"{t.minutes} min | {caught} |")
    tasks = [t for b in books for t in b.tasks]
    total = sum(t.minutes for t in tasks)
    rows += ["", f"All {len(tasks)} tasks: about {hours(total)} of a learner's time, "
             f"{sum(t.is_build for t in tasks)} of them inside the real engine."]
    return "\n".join(rows)


def times_region(books: list[Notebook]) -> str:
    """learner_path: each notebook's time, reading and tasks, adding up to the total."""
    rows = ["| # | notebook | reading, running, discussing | tasks | tasks' time | in all |",
            "|---|---|---:|---|---:|---:|"]
    for b in books:
        names = ", ".join(f"{number_of(t, b)}{' (Build)' if t.is_build else ''}" for t in b.tasks) or "—"
        rows.append(f"| {b.number} | {b.stem[3:]} | {b.reading_minutes} min | {names} | {hours(b.task_minutes)} | "
                    f"{hours(b.total_minutes)} |")
    reading = sum(b.reading_minutes for b in books)
    task_time = sum(b.task_minutes for b in books)
    rows.append(f"| all | {len(books)} notebooks | {hours(reading)} | {sum(len(b.tasks) for b in books)} tasks | "
                f"{hours(task_time)} | {hours(reading + task_time)} |")
    return "\n".join(rows)


def shortest(b: Notebook) -> Task | None:
    """The task to do when short on time: the quickest Build task, else the quickest task."""
    pool = [t for t in b.tasks if t.is_build] or list(b.tasks)
    return min(pool, key=lambda t: t.minutes) if pool else None


def short_region(books: list[Notebook]) -> str:
    """learner_path: the core thread, one task per notebook, and what the rest adds."""
    core = [b for b in books if b.number in CORE]

    def minutes(b: Notebook) -> int:
        task = shortest(b)
        return b.reading_minutes + (task.minutes if task else 0)

    lines = [f"**Short on time?** The core thread is {' → '.join(b.number for b in core)}: one request, the KV "
             "cache, the roofline of a step, continuous batching and the token budget. With one task per notebook "
             f"it takes about {hours(sum(minutes(b) for b in core))}. The other notebooks deepen it and can be "
             "read later, in any order after the core.", "",
             "| # | notebook | on the core thread | if short on time, do | time |", "|---|---|---|---|---:|"]
    for b in books:
        task = shortest(b)
        lines.append(f"| {b.number} | {b.stem[3:]} | {'yes' if b in core else 'later'} | "
                     f"{task_name(task, b) if task else 'read it'} | {hours(minutes(b))} |")
    return "\n".join(lines)


def tested_in(task: Task) -> list[str]:
    """The test files that name the task's checker (they pass the reference and fail planted bugs)."""
    short = task.checker.rsplit(".", 1)[1]
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")
                  if re.search(rf"\b{short}\b", p.read_text(encoding="utf-8"))
                  and p.name not in ("test_answer_key.py", "test_learner_docs.py"))


def check_cells_region(books: list[Notebook]) -> str:
    """learner_path: each notebook's check cells, the tests of those checkers, and how to run the notebook."""
    rows = ["| # | check cell calls (`labkit.course.`) | tests of those checkers | run the notebook as the test suite "
            "does |", "|---|---|---|---|"]
    for b in books:
        calls = ", ".join(f"`{t.checker.removeprefix('labkit.course.')}`" for t in b.tasks) or "—"
        tests = sorted({path for t in b.tasks for path in tested_in(t)})
        rows.append(f"| {b.number} | {calls} | {' '.join(f'`{p}`' for p in tests) or '—'} | "
                    f"`LABKIT_SMOKE=1 pytest notebooks/{b.stem}.ipynb` |")
    return "\n".join(rows)


def agenda_region(books: list[Notebook]) -> str:
    """instructor_guide: every notebook, in order, packed into half-day sessions of about 3.5 hours."""
    sessions: list[list[Notebook]] = [[]]
    for b in books:
        if sessions[-1] and sum(x.total_minutes for x in sessions[-1]) + b.total_minutes > SESSION_MINUTES:
            sessions.append([])
        sessions[-1].append(b)
    days = (len(sessions) + 1) // 2
    lines = [f"### The whole workbook in {days} days", "",
             f"Every notebook {books[0].number}–{books[-1].number} with every task, in half-day sessions of about "
             f"{hours(SESSION_MINUTES)} (breaks aside), from the times of docs/learner_path.md "
             "(reading, running and discussing, plus each task's expected time).", "",
             "| session | notebooks | Build tasks in class | time |", "|---|---|---|---:|"]
    for i, session in enumerate(sessions):
        label = f"day {i // 2 + 1}, {'morning' if i % 2 == 0 else 'afternoon'}"
        nbs = ", ".join(f"**{b.number}** {b.stem[3:].replace('_', ' ')}" for b in session)
        build = "; ".join(f"{b.number} Task {number_of(t, b)} ({t.title})" for b in session for t in b.tasks
                          if t.is_build) or "—"
        lines.append(f"| {label} | {nbs} | {build} | {hours(sum(b.total_minutes for b in session))} |")
    return "\n".join(lines)


def install_size_region() -> str:
    """README: the installed size of .venv, as measured by scripts/measure_install_size.py."""
    if not INSTALL_SIZE.is_file():
        return "the installed `.venv` size is not measured yet: run `.venv/bin/python scripts/measure_install_size.py`"
    size = json.loads(INSTALL_SIZE.read_text(encoding="utf-8"))
    return (f"the installed `.venv` takes {size['bytes'] / 1e9:.1f} GB, measured by `scripts/measure_install_size.py` "
            f"on {size['platform']}, {size['date']}")


Region = Callable[[list[Notebook]], str]
REGIONS: dict[Path, dict[str, Region]] = {
    README: {"tasks-path": path_region, "tasks-install-size": lambda _: install_size_region()},
    LEARNER_PATH: {"tasks-table": task_table, "tasks-times": times_region, "tasks-short": short_region,
                   "tasks-check-cells": check_cells_region},
    INSTRUCTOR_GUIDE: {"tasks-table": task_table, "tasks-agenda": agenda_region},
}


class RegionError(Exception):
    """A document lacks a generated region it should have."""


def with_region(text: str, name: str, body: str, path: Path) -> str:
    """``text`` with region ``name`` replaced by ``body`` (a one-line region stays inline)."""
    begin, end = f"<!-- BEGIN GENERATED: {name} -->", f"<!-- END GENERATED: {name} -->"
    if text.count(begin) != 1 or text.count(end) != 1:
        raise RegionError(f"{path.name} needs exactly one {begin} ... {end} region")
    head, rest = text.split(begin, 1)
    old, tail = rest.split(end, 1)
    sep = "" if "\n" not in old else "\n"
    return f"{head}{begin}{sep}{body}{sep}{end}{tail}"


def render(path: Path, text: str, books: list[Notebook]) -> str:
    for name, region in REGIONS[path].items():
        text = with_region(text, name, region(books), path)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated region is out of date")
    args = parser.parse_args()
    books = notebooks()
    stale = []
    for path in REGIONS:
        text = path.read_text(encoding="utf-8")
        new = render(path, text, books)
        if args.check:
            if new != text:
                stale.append(path.relative_to(ROOT).as_posix())
            continue
        if new != text:
            path.write_text(new, encoding="utf-8")
        print(f"{'wrote' if new != text else 'unchanged'} {path.relative_to(ROOT)}")
    if stale:
        sys.exit(f"out of date: {', '.join(stale)}: run .venv/bin/python scripts/make_learner_docs.py")


if __name__ == "__main__":
    main()
