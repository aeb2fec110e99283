"""Staged hints: a task's help in three levels, asked for one at a time, and the words for each way it can fail.

A Build task's text states the goal, the interface and the invariants; the learner makes the key choices. When
stuck, the learner asks for more, one level at a time (a notebook's collapsed hint cells call ``show_hint``):

1. ``concept``: a question or a concept that points at the choice to make;
2. ``rule``: the rule in words;
3. ``code``: code-level help, close to the answer.

A checker tags each failure with a class (``check.expect(ok, "...", because="victim-not-newest")``); a ``[FAIL]``
prints the failure-specific messages, then only the ``by_failure`` hints of the classes that failed, then a pointer
to ``show_hint(task, 2)``. The code-level hint is never printed unless asked for. Introduced in notebook 00
(``00_setup_and_hardware``).
"""

from __future__ import annotations

import pkgutil
from collections.abc import Mapping
from dataclasses import dataclass, field

from labkit.course.tasks import TASKS

__all__ = ["LEVELS", "Hints", "hints_of", "show_hint"]

LEVELS = {1: "a question to start from", 2: "the rule in words", 3: "code-level"}


@dataclass(frozen=True)
class Hints:
    """A task's three hint levels and, per failure class, the hint (in words) that addresses it. Notebook 00."""

    concept: str  # level 1: a question or a concept
    rule: str  # level 2: the rule in words
    code: str  # level 3: code-level
    by_failure: Mapping[str, str] = field(default_factory=dict)  # failure class -> a hint in words

    def __post_init__(self) -> None:
        for level, text in ((1, self.concept), (2, self.rule), (3, self.code)):
            if not text.strip():
                raise ValueError(f"hint level {level} ({LEVELS[level]}) is empty: every level needs a text")
        for key, text in self.by_failure.items():
            if not key or not text.strip():
                raise ValueError(f"by_failure entry {key!r} needs a non-empty class and hint")

    def level(self, level: int) -> str:
        """The text of hint ``level`` (1, 2 or 3)."""
        if level not in LEVELS:
            raise ValueError(f"hint level must be 1, 2 or 3 (1: {LEVELS[1]}, 2: {LEVELS[2]}, 3: {LEVELS[3]}), "
                             f"got {level!r}")
        return {1: self.concept, 2: self.rule, 3: self.code}[level]


def hints_of(task_id: str) -> Hints | None:
    """The ``Hints`` of task ``task_id`` (``"07.preempt"``), or None if the task has none."""
    if task_id not in TASKS:
        raise KeyError(f"no task {task_id!r}; the tasks are {', '.join(TASKS)}")
    name = TASKS[task_id].hints
    if not name:
        return None
    hints = pkgutil.resolve_name(name)
    if not isinstance(hints, Hints):
        raise TypeError(f"{name} (the hints of task {task_id}) is a {type(hints).__name__}, not a Hints")
    return hints


def show_hint(task_id: str, level: int = 1) -> None:
    """Print hint ``level`` of task ``task_id``: 1 a question, 2 the rule in words, 3 code-level."""
    hints = hints_of(task_id)
    task = TASKS[task_id]
    if hints is None:
        print(f"Task {task_id} ({task.title}) has no staged hints; its task text says what to build.")
        return
    text = hints.level(level)
    print(f"Hint {level} of 3 for {task_id} ({task.title}), {LEVELS[level]}:\n{text}")
    if level < 3:
        print(f"(More: show_hint({task_id!r}, {level + 1}).)")
