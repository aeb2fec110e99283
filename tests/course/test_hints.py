"""Staged hints and the [PASS]/[FAIL] text (labkit.course.hints, labkit.course.Check) and verdict predictions."""

from __future__ import annotations

import pytest

from labkit.course import TASKS, Check, Hints, Task, run_checker, show_hint, task_label
from labkit.course.hints import hints_of
from labkit.measure.rounds import Rounds
from labkit.measure.verdict import compare, reaches, trend

FAKE_HINTS = Hints(
    concept="Which request has done the least work?",
    rule="Preempt the newest running request while the pool is short.",
    code="victim = self.running[-1]  # CODE-LEVEL",
    by_failure={"oldest": "the oldest request has done the most work: preempting it wastes the most",
                "leak": "a preempted request's blocks go back to the pool"},
)


@pytest.fixture
def fake_task(monkeypatch: pytest.MonkeyPatch) -> str:
    task = Task("99.fake", "99_fake", "a fake task", "x.y", "x.check", "x.y", 5, hints=f"{__name__}.FAKE_HINTS")
    monkeypatch.setitem(TASKS, task.id, task)
    return task.id


def test_a_failure_prints_only_the_hints_of_the_classes_that_failed_never_the_code(fake_task: str) -> None:
    def body(check: Check) -> None:
        check.expect(True, "fine", because="leak")
        check.expect(False, "step 3: your reserve preempted R0 (the oldest)", because="oldest")
        check.expect(False, "step 5: again R0", because="oldest")

    message = run_checker("", "", body, task_id=fake_task).message()
    assert message.startswith("[FAIL] Task 1 (a fake task): 2 check(s) failed."), message
    assert "step 3: your reserve preempted R0" in message
    assert message.count(FAKE_HINTS.by_failure["oldest"]) == 1  # once per class, however often it failed
    assert FAKE_HINTS.by_failure["leak"] not in message  # a class that did not fail
    assert "CODE-LEVEL" not in message and FAKE_HINTS.rule not in message
    assert "show_hint('99.fake', 2) for more" in message


def test_the_pass_line_has_one_form(fake_task: str) -> None:
    assert run_checker("", "", lambda check: None, task_id=fake_task).message() == \
        "[PASS] Task 1 (a fake task): all checks passed."
    assert task_label("07.preempt") == "Task 2 (preemption by recompute)"


def test_an_unknown_failure_class_is_a_programming_error(fake_task: str) -> None:
    check = Check("Task 1 (a fake task)", task_id=fake_task)
    with pytest.raises(KeyError, match="not in the by_failure hints"):
        check.expect(True, "fine", because="no-such-class")


def test_show_hint_prints_one_level_at_a_time(fake_task: str, capsys: pytest.CaptureFixture[str]) -> None:
    show_hint(fake_task)
    first = capsys.readouterr().out
    assert FAKE_HINTS.concept in first and FAKE_HINTS.rule not in first and "CODE-LEVEL" not in first
    assert "show_hint('99.fake', 2)" in first
    show_hint(fake_task, 3)
    assert "CODE-LEVEL" in capsys.readouterr().out
    with pytest.raises(ValueError, match="1, 2 or 3"):
        show_hint(fake_task, 4)
    with pytest.raises(KeyError, match="no task"):
        show_hint("99.nope")


def test_every_task_with_hints_resolves_to_three_nonempty_levels() -> None:
    for task_id, task in TASKS.items():
        if task.hints:
            hints = hints_of(task_id)
            assert hints is not None and all(hints.level(n).strip() for n in (1, 2, 3)), task_id
            if task_id[:2] <= "10":  # chapters 00-10 tag every failure with a class (later chapters: their own tests)
                assert hints.by_failure, f"{task_id}: no by_failure hints"


def test_every_task_of_chapters_00_to_10_has_staged_hints() -> None:
    missing = [t.id for t in TASKS.values() if t.id[:2] <= "10" and not t.hints]
    assert missing == []


@pytest.mark.parametrize("task_id", [t for t in TASKS if t[:2] <= "10"])
def test_a_not_started_task_points_to_its_first_hint_and_never_prints_code(task_id: str) -> None:
    task = TASKS[task_id]
    checker, reference = task.load_checker(), task.load_reference()

    def stub(*args: object, **kwargs: object) -> None:
        raise NotImplementedError

    method = task.symbol.rsplit(".", 1)[1]
    candidate = type("Stub", (reference,), {method: stub}) if isinstance(reference, type) else stub
    result = checker(candidate)
    assert result.status == "not started", result.message()
    assert f"show_hint({task_id!r})" in result.message() and hints_of(task_id).code not in result.message()


def test_a_hint_level_must_have_text() -> None:
    with pytest.raises(ValueError, match="level 3"):
        Hints("q", "r", " ")


def _rounds() -> Rounds:
    rounds = Rounds()
    for fast, slow in ((2.0, 1.0), (2.1, 1.0), (1.9, 1.0)):
        rounds.add("fast", {"tok_s": fast})
        rounds.add("slow", {"tok_s": slow})
    return rounds


def test_a_verdict_prints_the_prediction_beside_the_measurement() -> None:
    rounds = _rounds()
    def verdict(**prediction: object) -> str:
        return compare(rounds, "fast", "slow", "tok_s", True, "fast is faster", **prediction).text  # type: ignore[arg-type]

    assert "predicted" not in verdict() and "no prediction" not in verdict()  # a verdict that asked for none
    assert verdict(prediction=3.0).splitlines()[0].endswith("; you predicted 3"), verdict(prediction=3.0)
    assert verdict(prediction=None).splitlines()[0].endswith("; no prediction recorded")
    assert trend([1, 2], [[1.0, 1.1], [2.0, 2.1]], "rises", "it rises", prediction="2x").text.endswith(
        "; you predicted 2x")
    assert reaches([0.9, 0.95], 0.5, "it reaches half", prediction=0.7).text.endswith("; you predicted 0.7")
