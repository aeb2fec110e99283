"""The exercise mechanism: a checker per task, shared by the notebooks' check cells and by tests/.

A notebook's "Task N" names the labkit symbol it builds and gives a stub that raises
``NotImplementedError``: a function that mirrors labkit's, or a subclass of labkit's class that replaces
one method (``BlockManager.slot``, ``Scheduler.schedule_waiting``, ...) and runs inside the real engine
through its options (``block_manager_cls=``, ``scheduler_cls=``, ``kv_cache_cls=``). Its check cell calls
the task's checker, which

* runs the same assertions the test suite runs (tests/ call these very checkers on the reference
  and on planted bugs), and prints a clear pass/fail: the failure-specific messages and, for the failure classes
  that failed, a hint in words (``labkit.course.hints``; the code-level hint only when the learner asks);
* returns what the rest of the notebook should use: the learner's function or class when it passes,
  otherwise labkit's reference, with a visible note, so the notebook still runs top to bottom.

Introduced in notebook 00 (``00_setup_and_hardware``).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from labkit.course.hints import Hints, hints_of, show_hint
from labkit.course.tasks import TASKS, Task

__all__ = ["TASKS", "Check", "CheckResult", "Hints", "Task", "run_checker", "show_hint", "task_label",
           "use_or_reference", "where_in_learner_code"]

F = TypeVar("F", bound=Callable[..., Any])
LABKIT_DIR = Path(__file__).resolve().parents[1]
SHOWN_FAILURES = 6  # a check cell lists at most this many failures, and says how many it left out


def where_in_learner_code(exc: BaseException) -> str:
    """' (in your next_token, line N)': the innermost frame of ``exc`` outside labkit (the learner's code)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not Path(f.filename).resolve().is_relative_to(LABKIT_DIR)]
    return f" (in your {frames[-1].name}, line {frames[-1].lineno})" if frames else ""


@dataclass
class CheckResult:
    """Outcome of checking one task. ``status`` is "passed", "failed" or "not started".

    ``task`` is the label "Task N (title)"; ``task_id`` ("07.preempt") names its entry in ``TASKS``, whose staged
    hints (``labkit.course.hints``) a failure points to; ``because`` holds the failure classes that failed, in order.
    ``hint`` is the older single hint line, printed only by checkers that have no staged hints."""

    task: str
    status: str
    failures: list[str] = field(default_factory=list)
    hint: str = ""
    task_id: str = ""
    because: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def failure_hints(self) -> list[str]:
        """The ``by_failure`` hints of the classes that failed, each once, in the order they failed."""
        hints = hints_of(self.task_id) if self.task_id else None
        if hints is None:
            return []
        return [hints.by_failure[key] for key in dict.fromkeys(self.because) if key in hints.by_failure]

    def message(self) -> str:
        # Plain-text marks: emoji render as empty boxes where no emoji font is installed.
        if self.passed:
            return f"[PASS] {self.task}: all checks passed."
        if self.status == "not started":
            first = f" Stuck? show_hint({self.task_id!r}) asks a first question." if self.task_id else ""
            return f"[TO DO] {self.task}: not implemented yet (the stub raises NotImplementedError).{first}"
        lines = [f"[FAIL] {self.task}: {len(self.failures)} check(s) failed."]
        lines += [f"   - {f}" for f in self.failures[:SHOWN_FAILURES]]
        if len(self.failures) > SHOWN_FAILURES:
            lines.append(f"   ... and {len(self.failures) - SHOWN_FAILURES} more (fix the first ones first: "
                         "later failures often follow from them)")
        if self.task_id:
            lines += [f"   Think about: {h}" for h in self.failure_hints()]
            lines.append(f"   show_hint({self.task_id!r}, 2) for more (the rule in words).")
        elif self.hint:
            lines.append(f"   Hint: {self.hint}")
        return "\n".join(lines)


class Check:
    """Collects failed assertions for one task instead of stopping at the first one."""

    def __init__(self, task: str, hint: str = "", task_id: str = "") -> None:
        if task_id and task_id not in TASKS:
            raise KeyError(f"no task {task_id!r} in labkit.course.TASKS")
        self.result = CheckResult(task=task, status="passed", hint=hint, task_id=task_id)
        self._hints = hints_of(task_id) if task_id else None

    def knows(self, because: str) -> bool:
        """Whether ``because`` is a failure class of this task's hints."""
        return self._hints is not None and because in self._hints.by_failure

    def expect(self, condition: bool, failure: str, because: str = "") -> None:
        """Record ``failure`` unless ``condition``; ``because`` is its failure class (a key of the task's
        ``Hints.by_failure``), whose hint the ``[FAIL]`` message then prints."""
        if because and self._hints is not None and because not in self._hints.by_failure:
            raise KeyError(f"failure class {because!r} is not in the by_failure hints of task "
                           f"{self.result.task_id} ({', '.join(self._hints.by_failure)})")
        if not condition:
            self.result.status = "failed"
            self.result.failures.append(failure)
            if because:
                self.result.because.append(because)

    def close(self, exc: BaseException | None = None) -> CheckResult:
        if isinstance(exc, NotImplementedError):
            self.result.status = "not started"
        elif exc is not None:
            self.result.status = "failed"
            tb = traceback.extract_tb(exc.__traceback__)
            where = f" (line {tb[-1].lineno})" if tb else ""
            self.result.failures.append(f"raised {type(exc).__name__}: {exc}{where}")
        return self.result


def task_label(task_id: str) -> str:
    """'Task N (title)': N is the task's place among its notebook's tasks in ``TASKS``."""
    task = TASKS[task_id]
    same = [t.id for t in TASKS.values() if t.notebook == task.notebook]
    return f"Task {same.index(task_id) + 1} ({task.title})"


def run_checker(task: str, hint: str, body: Callable[[Check], None], task_id: str = "") -> CheckResult:
    """Run ``body`` (which calls ``check.expect``) and turn any exception into a result. With ``task_id`` the
    failures point to the task's staged hints (and ``hint`` is not printed); ``task`` "" means ``task_label``."""
    check = Check(task or task_label(task_id), hint, task_id)
    try:
        body(check)
    except Exception as exc:  # the learner's code may raise anything; report it, do not crash the notebook
        return check.close(exc)
    return check.close()


def use_or_reference(result: CheckResult, candidate: F, reference: F, verbose: bool = True) -> F:
    """The learner's function or class if it passed, else labkit's reference (saying so)."""
    if verbose:
        print(result.message())
    if result.passed:
        if verbose:
            print("   -> From here on this notebook uses your code. Cells below that ran before this check used "
                  "labkit's reference: re-run them (Run > Run Selected Cell and All Below) to see your code's results.")
        return candidate
    if verbose:
        name = getattr(reference, "__qualname__", repr(reference))
        module = getattr(reference, "__module__", "labkit")
        print(f"   -> The rest of this notebook uses labkit's reference {module}.{name} until this task passes.")
    return reference
