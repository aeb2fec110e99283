"""docs/answer_key.md is generated from the notebooks and labkit, covers every Task, and each reference passes."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import pkgutil
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

import labkit.course
from labkit.course.tasks import Task as RegistryTask

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "make_answer_key.py"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_answer_key", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_answer_key"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


key = load_script()
TASKS = key.collect_tasks()


def cells(path: Path) -> list[tuple[str, str]]:
    return [(c["cell_type"], "".join(c["source"])) for c in json.loads(path.read_text())["cells"]]


def test_committed_answer_key_is_up_to_date() -> None:
    committed = (ROOT / "docs" / "answer_key.md").read_text(encoding="utf-8")
    assert committed == key.render(TASKS), "docs/answer_key.md is stale: run python scripts/make_answer_key.py"


def test_every_task_of_every_notebook_is_in_the_key() -> None:
    # Parsed here independently of the generator: any markdown line that names a "Task N" as a heading.
    headings = {(p.stem, int(n)) for p in NOTEBOOKS for kind, text in cells(p) if kind == "markdown"
                for n in re.findall(r"^#+\s*Task\s+(\d+)\b", text, re.MULTILINE)}
    assert headings, "the notebooks have exercises"
    assert {(t.notebook, t.number) for t in TASKS} == headings
    committed = (ROOT / "docs" / "answer_key.md").read_text(encoding="utf-8")
    for notebook, number in headings:
        assert f'<a id="{notebook[:2]}-task-{number}"></a>' in committed, f"{notebook} Task {number} missing"


def test_one_check_cell_per_task() -> None:
    for path in NOTEBOOKS:
        text = "\n".join(s for kind, s in cells(path) if kind == "code")
        num_checks = len(re.findall(r"use_or_reference\(\s*check_\w+\(", text))
        num_tasks = sum(t.notebook == path.stem for t in TASKS)
        assert num_checks == num_tasks, f"{path.name}: {num_checks} check cells for {num_tasks} tasks"


def test_every_checker_is_used_by_a_notebook_task() -> None:
    defined = set()
    chapters = [m.name for m in pkgutil.walk_packages(labkit.course.__path__, "labkit.course.")
                if m.name.split(".")[2].startswith("ch")]  # one module or folder per chapter
    assert len({name.split(".")[2] for name in chapters}) >= 14
    for name in chapters:
        module = importlib.import_module(name)
        defined |= {f"{module.__name__}.{name}" for name in dir(module)
                    if name.startswith("check_") and getattr(module, name).__module__ == module.__name__}
    assert defined == {t.checker_name for t in TASKS}, "a checker no notebook calls, or a task with no checker"


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.key)
def test_the_key_shows_a_reference_that_passes_the_checker(task) -> None:  # type: ignore[no-untyped-def]
    result = task.checker(task.reference)
    assert result.passed, result.message()
    assert "def " + task.mirrored.__name__ in key.source_block(task.mirrored)


def defined_in(value: object, filename: str) -> bool:
    """A function, or a class with a method, whose code comes from ``filename`` (not something it imports)."""
    if inspect.isfunction(value):
        return value.__code__.co_filename == filename
    return inspect.isclass(value) and any(defined_in(v, filename) for v in vars(value).values())


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.key)
def test_the_stub_in_the_key_is_reported_not_started(task) -> None:  # type: ignore[no-untyped-def]
    namespace: dict[str, object] = {}
    exec(compile(task.stub, f"<{task.key} stub>", "exec"), namespace)  # the notebook's own stub cell
    defined = [v for v in namespace.values() if defined_in(v, f"<{task.key} stub>")]
    assert len(defined) == 1, f"the stub cell should define one function or class, defined {list(namespace)}"
    if task.is_subclass:  # a subclass of labkit's class that overrides the method the task replaces
        assert issubclass(defined[0], task.reference) and task.mirrored.__name__ in vars(defined[0])
    assert task.checker(defined[0]).status == "not started"


def write_notebook(folder: Path, name: str, sources: list[tuple[str, str]]) -> None:
    nb = {"cells": [{"cell_type": kind, "metadata": {}, "source": text, **({"outputs": [], "execution_count": None}
                                                                           if kind == "code" else {})}
                    for kind, text in sources], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (folder / name).write_text(json.dumps(nb))


TASK_MD = ("### Task 1 — the roofline\n\nWrite `roof`. It mirrors "
           "**`labkit.measure.hardware.attainable_flops`**.")
STUB = "def roof(intensity, peak_flops, bandwidth):\n    raise NotImplementedError"
CHECK = ("from labkit.course import use_or_reference\n"
         "from labkit.course.ch00_setup_and_hardware import check_attainable_flops\n"
         "from labkit.measure.hardware import attainable_flops\n\n"
         "roof = use_or_reference(check_attainable_flops(roof), roof, attainable_flops)")

CLASS_TASK_MD = ("### Task 1 — the admission rule\n\nOverride `schedule_waiting`. It replaces "
                 "**`labkit.core.sched.scheduler.Scheduler.schedule_waiting`** in the engine.")
CLASS_STUB = ("from labkit import Scheduler\n\n\nclass MyScheduler(Scheduler):\n"
              "    def schedule_waiting(self, out, budget, now):\n        raise NotImplementedError")
CLASS_CHECK = ("from labkit import Scheduler\nfrom labkit.course import use_or_reference\n"
               "from labkit.course.ch07_continuous_batching import check_schedule_waiting\n\n"
               "MyScheduler = use_or_reference(check_schedule_waiting(MyScheduler), MyScheduler, Scheduler)")


def demo_registry(checker: str, reference: str, symbol: str, hints: str = "") -> dict[str, RegistryTask]:
    entry = RegistryTask("42.demo", "42_demo", "demo", symbol, checker, reference, 5, hints=hints)
    return {entry.id: entry}


ROOF_REGISTRY = demo_registry("labkit.course.ch00_setup_and_hardware.check_attainable_flops",
                              "labkit.measure.hardware.attainable_flops", "labkit.measure.hardware.attainable_flops")
CLASS_REGISTRY = demo_registry("labkit.course.ch07_continuous_batching.check_schedule_waiting",
                               "labkit.core.sched.scheduler.Scheduler",
                               "labkit.core.sched.scheduler.Scheduler.schedule_waiting",
                               "labkit.course.ch07_continuous_batching.ADMISSION_HINTS")


def test_collects_a_task_and_resolves_names_through_the_notebook_imports(tmp_path: Path) -> None:
    write_notebook(tmp_path, "42_demo.ipynb", [("markdown", TASK_MD), ("code", STUB), ("code", CHECK)])
    (task,) = key.collect_tasks(tmp_path, ROOF_REGISTRY)
    from labkit.course.ch00_setup_and_hardware import check_attainable_flops
    from labkit.measure.hardware import attainable_flops

    assert (task.notebook, task.number, task.title) == ("42_demo", 1, "the roofline")
    assert task.checker is check_attainable_flops and task.reference is attainable_flops
    assert task.mirrored is attainable_flops and not task.is_subclass
    text = key.render([task])
    assert '<a id="42-task-1"></a>' in text and "def attainable_flops(" in text and STUB in text


def test_a_subclass_task_shows_the_method_it_replaces(tmp_path: Path) -> None:
    write_notebook(tmp_path, "42_demo.ipynb", [("markdown", CLASS_TASK_MD), ("code", CLASS_STUB),
                                               ("code", CLASS_CHECK)])
    (task,) = key.collect_tasks(tmp_path, CLASS_REGISTRY)
    from labkit import Scheduler

    assert task.is_subclass and task.reference is Scheduler and task.mirrored is Scheduler.schedule_waiting
    text = key.render([task])
    assert "The staged hints (`show_hint`):" in text and "budget" in text  # the task's three hint levels
    assert "Replaces `labkit.core.sched.scheduler.Scheduler.schedule_waiting` in a subclass of" in text
    assert "def schedule_waiting(" in text and "class Scheduler" not in text  # the method, not the whole class


def test_a_task_without_a_check_cell_is_an_error_naming_it(tmp_path: Path) -> None:
    write_notebook(tmp_path, "42_demo.ipynb", [("markdown", TASK_MD), ("code", STUB)])
    with pytest.raises(key.AnswerKeyError, match=r"42_demo.ipynb, Task 1: expected a stub cell"):
        key.collect_tasks(tmp_path, ROOF_REGISTRY)


def test_a_task_that_names_no_mirrored_symbol_is_an_error(tmp_path: Path) -> None:
    write_notebook(tmp_path, "42_demo.ipynb", [("markdown", "### Task 1 — the roofline\n\nWrite `roof`."),
                                               ("code", STUB), ("code", CHECK)])
    with pytest.raises(key.AnswerKeyError, match="which labkit symbol it mirrors"):
        key.collect_tasks(tmp_path, ROOF_REGISTRY)


def test_an_unimported_reference_is_an_error(tmp_path: Path) -> None:
    check = CHECK.replace("from labkit.measure.hardware import attainable_flops\n", "")
    write_notebook(tmp_path, "42_demo.ipynb", [("markdown", TASK_MD), ("code", STUB), ("code", check)])
    with pytest.raises(key.AnswerKeyError, match="cannot tell where 'attainable_flops' comes from"):
        key.collect_tasks(tmp_path, ROOF_REGISTRY)


def test_a_notebook_task_missing_from_the_registry_is_an_error(tmp_path: Path) -> None:
    write_notebook(tmp_path, "42_demo.ipynb", [("markdown", TASK_MD), ("code", STUB), ("code", CHECK)])
    with pytest.raises(key.AnswerKeyError, match="TASKS has 0 entries for notebook 42_demo"):
        key.collect_tasks(tmp_path, CLASS_REGISTRY)


def test_a_registry_task_no_notebook_has_is_an_error(tmp_path: Path) -> None:
    write_notebook(tmp_path, "42_demo.ipynb", [("markdown", TASK_MD), ("code", STUB), ("code", CHECK)])
    extra = demo_registry("labkit.course.ch07_continuous_batching.check_schedule_waiting",
                          "labkit.core.sched.scheduler.Scheduler",
                          "labkit.core.sched.scheduler.Scheduler.schedule_waiting")
    extra = {"42.other": dataclasses.replace(extra["42.demo"], id="42.other"), **ROOF_REGISTRY}
    with pytest.raises(key.AnswerKeyError, match="TASKS lists 42.other, which no notebook has"):
        key.collect_tasks(tmp_path, extra)
