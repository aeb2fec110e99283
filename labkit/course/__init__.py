"""The exercise mechanism: a checker per task, shared by the notebooks' check cells and by tests/.

A notebook's "Task N" names the labkit symbol it builds and gives a stub that raises
``NotImplementedError``: a function that mirrors labkit's, or a subclass of labkit's class that replaces
one method (``BlockManager.slot``, ``Scheduler.schedule_waiting``, ...) and runs inside the real engine
through its options (``block_manager_cls=``, ``scheduler_cls=``, ``kv_cache_cls=``). Its check cell calls
the task's checker, which

* runs the same assertions the test suite runs (tests/ call these very checkers on the reference
  and on planted bugs), and prints a clear pass/fail with a hint;
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

from labkit.course.tasks import TASKS, Task

__all__ = ["TASKS", "Check", "CheckResult", "Task", "run_checker", "use_or_reference", "where_in_learner_code"]

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
    """Outcome of checking one task. ``status`` is "passed", "failed" or "not started"."""

    task: str
    status: str
    failures: list[str] = field(default_factory=list)
    hint: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def message(self) -> str:
        # Plain-text marks: emoji render as empty boxes where no emoji font is installed.
        if self.passed:
            return f"[PASS] {self.task}: all checks passed."
        if self.status == "not started":
            return f"[TO DO] {self.task}: not implemented yet (the stub raises NotImplementedError)."
        lines = [f"[FAIL] {self.task}: {len(self.failures)} check(s) failed."]
        lines += [f"   - {f}" for f in self.failures[:SHOWN_FAILURES]]
        if len(self.failures) > SHOWN_FAILURES:
            lines.append(f"   ... and {len(self.failures) - SHOWN_FAILURES} more (fix the first ones first: "
                         "later failures often follow from them)")
        if self.hint:
            lines.append(f"   Hint: {self.hint}")
        return "\n".join(lines)


class Check:
    """Collects failed assertions for one task instead of stopping at the first one."""

    def __init__(self, task: str, hint: str = "") -> None:
        self.result = CheckResult(task=task, status="passed", hint=hint)

    def expect(self, condition: bool, failure: str) -> None:
        if not condition:
            self.result.status = "failed"
            self.result.failures.append(failure)

    def close(self, exc: BaseException | None = None) -> CheckResult:
        if isinstance(exc, NotImplementedError):
            self.result.status = "not started"
        elif exc is not None:
            self.result.status = "failed"
            tb = traceback.extract_tb(exc.__traceback__)
            where = f" (line {tb[-1].lineno})" if tb else ""
            self.result.failures.append(f"raised {type(exc).__name__}: {exc}{where}")
        return self.result


def run_checker(task: str, hint: str, body: Callable[[Check], None]) -> CheckResult:
    """Run ``body`` (which calls ``check.expect``) and turn any exception into a result."""
    check = Check(task, hint)
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
