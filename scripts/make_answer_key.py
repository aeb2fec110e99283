"""Generate docs/answer_key.md from the notebooks and ``labkit.course.TASKS``: every notebook exercise with labkit's
reference solution and its staged hints, in one place (the guides' task tables: scripts/make_learner_docs.py).

    .venv/bin/python scripts/make_answer_key.py           # (re)write docs/answer_key.md
    .venv/bin/python scripts/make_answer_key.py --check   # exit 1 if docs/answer_key.md is out of date

Nothing here is written by hand: the tasks come from the notebooks themselves. For every "### Task N" heading
it finds the stub cell after it and the check cell ``x = use_or_reference(check_x(x), x, REFERENCE)``, and it
shows the source of the labkit symbol the task says it mirrors (``It mirrors **`labkit....`**``, a function) or
replaces (``It replaces **`labkit....Class.method`**``, a method the learner's subclass overrides and the engine
then runs), and of REFERENCE (what the notebook falls back to) when that is another function.
tests/course/test_answer_key.py fails when the committed key differs from a fresh one, when a notebook's task
is missing from it, or when a reference no longer passes its checker.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import pkgutil
import re
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labkit.course.hints import LEVELS, Hints
from labkit.course.tasks import TASKS
from labkit.course.tasks import Task as RegistryTask

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, not installed
NOTEBOOKS = ROOT / "notebooks"
ANSWER_KEY = ROOT / "docs" / "answer_key.md"

TASK_HEADING = re.compile(r"^#{2,4}\s*Task\s+(\d+)\s*[—–:\-]+\s*(.+?)\s*$", re.MULTILINE)
MIRRORS = re.compile(r"(?:mirrors|replaces)\s+\*\*`([\w.]+)`\*\*")


class AnswerKeyError(Exception):
    """A notebook's exercise does not follow the Task / stub / check-cell pattern."""


@dataclass
class Task:
    notebook: str  # e.g. "07_continuous_batching"
    number: int
    title: str
    mirrors: str  # dotted name of the labkit symbol the task mirrors (a function) or replaces (a method)
    stub: str  # the stub cell's source
    checker_name: str  # e.g. "labkit.course.ch07_continuous_batching.check_schedule_waiting"
    reference_expr: str  # the third argument of use_or_reference, as written in the notebook
    checker: Callable[..., Any]
    reference: Callable[..., Any]
    mirrored: Any
    entry: RegistryTask  # its entry in labkit.course.TASKS (expected minutes, mistakes caught)

    @property
    def key(self) -> str:
        return f"{self.notebook[:2]}-task-{self.number}"

    @property
    def is_subclass(self) -> bool:
        """The learner writes a subclass of labkit's class (the reference) overriding one method (mirrored)."""
        return inspect.isclass(self.reference)


def resolve_dotted(name: str) -> Any:
    """``labkit.a.b.C.f`` -> the object (``pkgutil.resolve_name``), as an AnswerKeyError if it is missing."""
    try:
        return pkgutil.resolve_name(name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise AnswerKeyError(str(exc)) from exc


def notebook_imports(cells: list[str]) -> dict[str, str]:
    """Every ``from M import a, b as c`` in a notebook's code cells: local name -> dotted ``M.a``."""
    names: dict[str, str] = {}
    for source in cells:
        code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
        try:
            tree = ast.parse(code)
        except SyntaxError:  # not Python (a cell magic): it imports nothing we need
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def check_call(source: str) -> tuple[str, str] | None:
    """(checker name, reference expression) of ``use_or_reference(check_x(...), candidate, REFERENCE)``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "use_or_reference"
                and len(node.args) >= 3 and isinstance(node.args[0], ast.Call)
                and isinstance(node.args[0].func, ast.Name)):
            return node.args[0].func.id, ast.unparse(node.args[2])
    return None


def resolve_name(expr: str, imports: dict[str, str]) -> str:
    """A notebook expression (``Scheduler`` or ``labkit.x.y``) -> its dotted name, via the notebook's imports."""
    head, _, rest = expr.partition(".")
    if head in imports:
        return imports[head] + (f".{rest}" if rest else "")
    if head == "labkit":
        return expr
    raise AnswerKeyError(f"cannot tell where {expr!r} comes from: import it with `from labkit... import {head}` "
                         f"or write it as labkit.<module>.{expr}")


def collect_tasks(notebooks: Path = NOTEBOOKS, registry: dict[str, RegistryTask] | None = None) -> list[Task]:
    """Every Task of every notebook, in order, with its stub, checker and reference resolved, each matched with its
    entry in ``registry`` (default: ``labkit.course.TASKS``), which must list exactly these tasks."""
    registry = TASKS if registry is None else registry
    tasks: list[Task] = []
    for path in sorted(notebooks.glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        sources = ["".join(c["source"]) for c in cells]
        imports = notebook_imports([s for c, s in zip(cells, sources) if c["cell_type"] == "code"])
        task_cells = [i for i, (c, s) in enumerate(zip(cells, sources))
                      if c["cell_type"] == "markdown" and TASK_HEADING.search(s)]
        for i, (cell, text) in enumerate(zip(cells, sources)):
            if cell["cell_type"] != "markdown":
                continue
            for match in TASK_HEADING.finditer(text):
                where = f"{path.name}, Task {match.group(1)}"
                mirrors = MIRRORS.search(text, match.end())
                if mirrors is None:
                    raise AnswerKeyError(f"{where}: the task text must say which labkit symbol it mirrors "
                                         "(It mirrors **`labkit....`**) or, for a subclass, which method it "
                                         "replaces (It replaces **`labkit....Class.method`**)")
                end = next((j for j in task_cells if j > i), len(cells))  # this task's cells end at the next task
                code_after = [sources[j] for j in range(i + 1, end) if cells[j]["cell_type"] == "code"]
                stub = next((s for s in code_after if "raise NotImplementedError" in s), None)
                check = next(filter(None, map(check_call, code_after)), None)
                if stub is None or check is None:
                    raise AnswerKeyError(f"{where}: expected a stub cell (raise NotImplementedError) and then a "
                                         "check cell calling use_or_reference(check_...(...), ..., reference)")
                checker_name = resolve_name(check[0], imports)
                reference_name = resolve_name(check[1], imports)
                entry = registry_entry(registry, path.stem, checker_name, where)
                tasks.append(Task(
                    notebook=path.stem, number=int(match.group(1)), title=match.group(2), mirrors=mirrors.group(1),
                    stub=stub.strip(), checker_name=checker_name, reference_expr=check[1],
                    checker=resolve_dotted(checker_name), reference=resolve_dotted(reference_name),
                    mirrored=resolve_dotted(mirrors.group(1)), entry=entry,
                ))
    missing = sorted(set(registry) - {t.entry.id for t in tasks})
    if missing:
        raise AnswerKeyError(f"labkit.course.TASKS lists {', '.join(missing)}, which no notebook has "
                             "(a Task heading followed by its stub and check cell)")
    return tasks


def registry_entry(registry: dict[str, RegistryTask], notebook: str, checker_name: str, where: str) -> RegistryTask:
    """The registry entry of a notebook's task, found by its notebook and its checker."""
    found = [t for t in registry.values() if t.notebook == notebook and t.checker == checker_name]
    if len(found) != 1:
        raise AnswerKeyError(f"{where}: labkit.course.TASKS has {len(found)} entries for notebook {notebook} with "
                             f"checker {checker_name}; add exactly one (labkit/course/tasks.py)")
    return found[0]


def staged_hints(task: Task) -> list[str]:
    """The task's three hint levels (``labkit.course.hints``), as markdown lines, or [] if it has none."""
    if not task.entry.hints:
        return []
    hints = resolve_dotted(task.entry.hints)
    if not isinstance(hints, Hints):
        raise AnswerKeyError(f"{task.entry.id}: {task.entry.hints} is not a labkit.course.hints.Hints")
    return ["The staged hints (`show_hint`):", "",
            *(f"{level}. *{LEVELS[level]}*: {hints.level(level)}" for level in (1, 2, 3)), ""]


def checker_hint(task: Task) -> str:
    """The hint the check cell prints on failure: run the checker on a stub that is not started."""

    def stub(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    if task.is_subclass:  # a subclass whose one method is not written yet
        return task.checker(type("Stub", (task.reference,), {task.mirrored.__name__: stub})).hint
    return task.checker(stub).hint


def tested_in(checker_name: str, tests: Path = ROOT / "tests") -> list[str]:
    """The test files that exercise a checker (they pass the reference and fail planted bugs)."""
    short = checker_name.rsplit(".", 1)[1]
    return sorted(p.relative_to(ROOT).as_posix() for p in tests.rglob("test_*.py")
                  if re.search(rf"\b{short}\b", p.read_text(encoding="utf-8")) and p.name != "test_answer_key.py")


def source_block(obj: Any) -> str:
    path = Path(inspect.getsourcefile(obj) or "").resolve()
    lines, _ = inspect.getsourcelines(obj)
    where = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name  # no line: edits above move it
    qualname = f"{obj.__module__}.{obj.__qualname__}"
    code = textwrap.dedent("".join(lines)).rstrip()  # a method's source is indented
    return f"`{qualname}` ({where}):\n\n```python\n{code}\n```"


def helpers_called(fn: Any, given: str) -> list[Any]:
    """labkit functions that ``fn`` calls by name, except those the stub already imports (``given``)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    names = dict.fromkeys(n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name))
    found = []
    for name in names:
        obj = getattr(fn, "__globals__", {}).get(name)
        if inspect.isfunction(obj) and obj.__module__.startswith("labkit") and not re.search(rf"\b{name}\b", given):
            found.append(obj)
            if only_delegates(obj):  # a wrapper (``sample`` -> ``sample_tokens``): the work is one call further
                found += [h for h in helpers_called(obj, given) if h not in found and h is not fn]
    return found


def only_delegates(fn: Any) -> bool:
    """Whether ``fn``'s body is one ``return`` statement (after its docstring): a wrapper around another call."""
    body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body  # type: ignore[attr-defined]
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return len(body) == 1 and isinstance(body[0], ast.Return)


def render(tasks: list[Task]) -> str:
    out = [
        "# Answer key",
        "",
        "<!-- Generated by scripts/make_answer_key.py from the notebooks and labkit's reference implementations. "
        "Do not edit by hand: run `.venv/bin/python scripts/make_answer_key.py`. "
        "tests/course/test_answer_key.py fails when this file is out of date. -->",
        "",
        "**Spoilers.** Every exercise of the workbook with the reference solution the notebook falls back to. "
        "Each solution is labkit's own code, the code the engines run, so a learner's answer is right when the "
        "check cell passes, not when it looks like this one: many other implementations pass too. The checker "
        "column names the function the check cell calls; the tests named beside it show that the checker passes "
        "this reference and fails planted bugs.",
        "",
        "| notebook | task | id | labkit symbol | runs inside | checker | tested in |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in tasks:
        tests = ", ".join(f"`{p}`" for p in tested_in(t.checker_name)) or "—"
        out.append(f"| {t.notebook} | [Task {t.number}: {t.title}](#{t.key}) | `{t.entry.id}` | `{t.mirrors}` | "
                   f"{t.entry.runs_inside or '—'} | `{t.checker_name.rsplit('.', 1)[1]}` | {tests} |")
    current = None
    for t in tasks:
        if t.notebook != current:
            current = t.notebook
            out += ["", f"## Notebook {t.notebook[:2]} · {t.notebook[3:]}"]
        out += [
            "", f'<a id="{t.key}"></a>', "", f"### Task {t.number}: {t.title}", "",
            (f"Replaces `{t.mirrors}` in a subclass of `{t.reference.__module__}.{t.reference.__qualname__}` that "
             "the engine runs." if t.is_subclass else f"Mirrors `{t.mirrors}`.")
            + f" Check cell: `{t.checker_name}`, falling back to `{t.reference_expr}`.", "",
            *(staged_hints(t) or [f"The checker's hint on failure: *{checker_hint(t)}*", ""]),
            "The stub the learner starts from:", "", f"```python\n{t.stub}\n```", "",
            "Reference solution, " + source_block(t.mirrored),
        ]
        for helper in helpers_called(t.mirrored, t.stub):
            out += ["", "which calls " + source_block(helper)]
        if t.reference is not t.mirrored and not t.is_subclass:
            out += ["", "The plain function the notebook falls back to, " + source_block(t.reference)]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed answer key is out of date")
    args = parser.parse_args()
    tasks = collect_tasks()  # the guides' task tables: scripts/make_learner_docs.py (regions tasks-*)
    outputs = {ANSWER_KEY: render(tasks)}
    for path, text in outputs.items():
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                sys.exit(f"{path.relative_to(ROOT)} is out of date: run .venv/bin/python scripts/make_answer_key.py")
            print(f"{path.relative_to(ROOT)} is up to date")
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
