"""Your engine's parts, gathered for the capstone of notebook 10: the classes you wrote in notebooks 06-08.

The Build tasks of notebooks 06, 07 and 08 are subclasses of labkit's ``BlockManager``, ``Scheduler`` and attention
backend, each in its own notebook. ``learner_parts()`` brings them into notebook 10 without copying anything:
it reads those notebooks as saved on disk, runs their import statements and their ``def``/``class`` statements
(nothing else: no experiment reruns) in one namespace per notebook, takes from each task's check cell
``X = use_or_reference(check_x(X), X, Reference)`` the class ``X`` you wrote, and runs ``check_x`` on it again.
Classes that pass are combined per engine option (``combine``: one class whose bases are your classes, so each
method comes from the part that overrides it); any part not done, or failing its check, is labkit's, and the
table it prints says so. ``EngineParts.options()`` is then what ``LLM(..., **options)`` takes.

Save your notebooks first (JupyterLab saves every two minutes; File > Save to be sure). Working in a copy of a
notebook? Pass its path: ``learner_parts(notebooks=["my_07.ipynb", ...])``. Introduced in notebook 10
(``10_profiling_host_overhead``).
"""

from __future__ import annotations

import ast
import json
import linecache
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.core.attention import PagedAttentionBackend, TorchAttentionBackend
from labkit.core.kv.block_manager import BlockManager
from labkit.core.sched.scheduler import Scheduler
from labkit.course import TASKS, CheckResult

ROOT = Path(__file__).resolve().parents[3]
# engine option -> (the base class a learner's part subclasses, labkit's own part)
PART_OPTIONS: dict[str, tuple[type, type]] = {
    "block_manager_cls": (BlockManager, BlockManager),
    "scheduler_cls": (Scheduler, Scheduler),
    "attention_backend": (PagedAttentionBackend, TorchAttentionBackend),
}
TASK_HEADING = re.compile(r"^#{2,4}\s*Task\s+(\d+)\s*[—–:\-]+\s*(.+?)\s*$", re.MULTILINE)
PAGED_ENGINES = ("paged", "continuous", "chunked")


@dataclass
class Part:
    """One Build task's class as the capstone found it in a notebook. Notebook 10."""

    option: str  # the engine option it plugs into ("scheduler_cls", ...)
    task: str  # e.g. "07 Task 2 (preemption by recompute)"
    name: str  # the class's name in the notebook
    cls: type | None  # what the notebook defines under that name (None: nothing)
    result: CheckResult | None  # its chapter's check, run again here

    @property
    def used(self) -> bool:
        return self.cls is not None and self.result is not None and self.result.passed

    def line(self) -> str:
        return f"{self.task:<44} {self.name:<22} {self.status()}"

    def status(self) -> str:
        if self.cls is None:
            return f"labkit's: {self.name} is not defined in the notebook"
        if self.result is None:
            return "labkit's: its check could not be imported from the notebook"
        if self.result.status == "not started":
            return "labkit's: not started"
        if not self.result.passed:
            return f"labkit's: its check failed ({self.result.failures[0] if self.result.failures else '?'})"
        return "yours"


@dataclass
class EngineParts:
    """The pluggable parts of one engine (vLLM's option names): yours where done, labkit's elsewhere. Notebook 10."""

    scheduler_cls: type[Scheduler] = Scheduler
    block_manager_cls: type[BlockManager] = BlockManager
    attention_backend: type[PagedAttentionBackend] = TorchAttentionBackend
    found: list[Part] = field(default_factory=list)  # what learner_parts() read, task by task

    def options(self) -> dict[str, Any]:
        """``LLM(model, engine="chunked", **parts.options())``."""
        return {option: getattr(self, option) for option in PART_OPTIONS}

    def is_labkits(self) -> bool:
        return all(getattr(self, option) is own for option, (_, own) in PART_OPTIONS.items())

    def describe(self, with_parts: bool = True) -> str:
        lines = [p.line() for p in self.found] if with_parts else []
        for option, (_, own) in PART_OPTIONS.items():
            cls = getattr(self, option)
            if cls is own:
                lines.append(f"-> {option} = labkit's {own.__name__}")
                continue
            where = ", ".join(f"{m} ({getattr(cls, m).__qualname__.split('.')[0]})" for m in overridden(cls, own))
            lines.append(f"-> {option} = {cls.__name__}: yours for {where}; labkit's {own.__name__} for the rest")
        return "\n".join(lines)


def overridden(cls: type, own: type) -> list[str]:
    """The methods of labkit's part ``own`` that ``cls`` (or a class between it and ``own``) overrides."""
    return sorted({name for c in cls.__mro__ if c not in own.__mro__ for name, value in vars(c).items()
                   if callable(value) and hasattr(own, name) and not name.startswith("__")})


def combine(own: type, classes: list[type], name: str) -> type:
    """One class from several learner classes that each override some methods of labkit's part ``own``: its bases
    are the classes themselves, so Python's method resolution takes each method from the first class that defines it.
    Later classes in ``classes`` come first (a later task's method wins); ``own`` when ``classes`` is empty."""
    chosen: list[type] = []
    for cls in reversed(classes):
        if cls is own or any(issubclass(c, cls) for c in chosen):
            continue  # labkit's own part, or already inside a chosen class (a later task subclassed it)
        chosen = [c for c in chosen if not issubclass(cls, c)] + [cls]
    if not chosen:
        return own
    if len(chosen) == 1:
        return chosen[0]
    return type(name, tuple(chosen), {"__doc__": f"Your {own.__name__}: {', '.join(c.__name__ for c in chosen)}."})


def combine_parts(*classes: type) -> EngineParts:
    """EngineParts from classes you pass yourself (pasted or imported): each goes to the option its base names."""
    parts = EngineParts()
    for option, (base, own) in PART_OPTIONS.items():
        mine = [c for c in classes if isinstance(c, type) and issubclass(c, base) and c is not own]
        setattr(parts, option, combine(own, mine, f"Your{base.__name__}"))
    return parts


def notebook_files(folder: Path | None = None) -> list[Path]:
    """The saved notebooks before this one whose Build tasks run inside the paged engines (06-08), from the task
    registry; ``folder`` defaults to the working directory if it holds them (a notebook's), else the workbook's."""
    if folder is None:
        folder = Path.cwd() if any(Path.cwd().glob("0[6-8]_*.ipynb")) else ROOT / "notebooks"
    names = sorted({t.notebook for t in TASKS.values()
                    if t.notebook[:2] < "10" and any(e in t.runs_inside for e in PAGED_ENGINES)})
    return [folder / f"{name}.ipynb" for name in names if (folder / f"{name}.ipynb").is_file()]


def find_check_call(tree: ast.Module) -> tuple[str, str, str] | None:
    """(candidate, checker, reference) names of ``X = use_or_reference(check_x(X), X, Reference)``."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "use_or_reference"
                and len(node.args) >= 3 and isinstance(node.args[0], ast.Call)
                and isinstance(node.args[0].func, ast.Name)
                and isinstance(node.args[1], ast.Name) and isinstance(node.args[2], ast.Name)):
            return node.args[1].id, node.args[0].func.id, node.args[2].id
    return None


def read_notebook(path: Path) -> Iterator[Part]:
    """Define a notebook's imports, functions and classes (cell order, nothing else run), then check its parts one
    by one."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    namespace: dict[str, Any] = {"__name__": f"notebook_{path.stem[:2]}"}
    calls: list[tuple[str, tuple[str, str, str]]] = []
    task = "?"
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            heading = TASK_HEADING.search(source)
            task = f"{path.stem[:2]} Task {heading.group(1)} ({heading.group(2)})" if heading else task
            continue
        code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
        try:
            tree = ast.parse(code)
        except SyntaxError:
            continue  # not Python (a cell magic), or a half-written cell: it defines nothing usable
        filename = f"<{path.name}, cell {i}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)  # for tracebacks
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                try:
                    exec(compile(ast.Module([node], []), filename, "exec"), namespace)
                except Exception:  # e.g. a class whose base another cell never defined: the check will say
                    pass
        call = find_check_call(tree)
        if call is not None:
            calls.append((task, call))
    for task, (name, checker, reference) in calls:
        for option, (base, _) in PART_OPTIONS.items():
            if isinstance(namespace.get(reference), type) and issubclass(namespace[reference], base):
                cls = namespace.get(name)
                cls = cls if isinstance(cls, type) and issubclass(cls, base) else None
                result = namespace[checker](cls) if cls is not None and checker in namespace else None
                yield Part(option, task, name, cls, result)


def learner_parts(notebooks: list[str | Path] | None = None, verbose: bool = True) -> EngineParts:
    """Your Build classes from the saved notebooks 06-08 (or ``notebooks``), each checked again, combined per engine
    option; labkit's part wherever yours is not done or fails its check. Prints what it finds as it goes."""
    files = [Path(p) for p in notebooks] if notebooks is not None else notebook_files()
    if verbose:
        print(f"Your engine's parts, from {', '.join(p.name for p in files) or 'no notebook found'}:")
    found = []
    for path in files:
        for part in read_notebook(path):
            found.append(part)
            if verbose:
                print(part.line(), flush=True)  # a part's check can take seconds: show each as it is done
    parts = EngineParts(found=found)
    for option, (base, own) in PART_OPTIONS.items():
        mine = [p.cls for p in found if p.option == option and p.used]
        setattr(parts, option, combine(own, mine, f"Your{base.__name__}"))  # type: ignore[arg-type]
    if verbose:
        print(parts.describe(with_parts=False))
    return parts
