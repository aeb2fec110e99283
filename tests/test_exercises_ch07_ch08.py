"""Checkers of notebooks 07 and 08 pass labkit's reference, fail planted bugs, and report unstarted stubs."""

from __future__ import annotations

from labkit.exercises import use_or_reference
from labkit.exercises.ch07 import check_admit_fcfs
from labkit.exercises.ch08 import check_fill_token_budget
from labkit.engine.sched.policy import admit_fcfs, fill_token_budget


def test_ch07_admission_checker_passes_the_reference() -> None:
    result = check_admit_fcfs(admit_fcfs)
    assert result.passed, result.message()


def test_ch07_admission_checker_fails_planted_bugs() -> None:
    def skips_instead_of_stopping(waiting, slots, budget, blocks):  # type: ignore[no-untyped-def]
        admitted = []
        for i, (tokens, need) in enumerate(waiting):
            if slots and tokens <= budget and need <= blocks:  # a small request jumps the queue: not FCFS
                admitted.append(i)
                slots, budget, blocks = slots - 1, budget - tokens, blocks - need
        return admitted

    def strict_budget(waiting, slots, budget, blocks):  # type: ignore[no-untyped-def]
        return admit_fcfs(waiting, slots, budget - 1, blocks)  # tokens < budget: an exact fit is refused

    def never_spends_the_budget(waiting, slots, budget, blocks):  # type: ignore[no-untyped-def]
        admitted = []
        for i, (tokens, need) in enumerate(waiting):
            if not slots or tokens > budget or need > blocks:
                break
            admitted.append(i)
            slots, blocks = slots - 1, blocks - need
        return admitted

    def ignores_blocks(waiting, slots, budget, blocks):  # type: ignore[no-untyped-def]
        return admit_fcfs(waiting, slots, budget, 10**9)

    for bug in (skips_instead_of_stopping, strict_budget, never_spends_the_budget, ignores_blocks):
        result = check_admit_fcfs(bug)
        assert result.status == "failed" and result.failures, bug.__name__


def test_ch08_budget_checker_passes_the_reference() -> None:
    result = check_fill_token_budget(fill_token_budget)
    assert result.passed, result.message()
    # plain tuples and dicts are accepted too
    assert check_fill_token_budget(lambda *a: tuple(fill_token_budget(*a))).passed
    assert check_fill_token_budget(lambda *a: fill_token_budget(*a)._asdict()).passed


def test_ch08_budget_checker_fails_planted_bugs() -> None:
    def prefills_first(num_decodes, partials, waiting, budget, slots):  # type: ignore[no-untyped-def]
        plan = fill_token_budget(0, partials, waiting, budget, slots)  # prompts take the budget first...
        left = budget - plan.num_batched_tokens
        decodes = [1 if k < left else 0 for k in range(num_decodes)]  # ...decodes get what is left: a stall
        return decodes, plan.partials, plan.waiting

    def whole_prompts_only(num_decodes, partials, waiting, budget, slots):  # type: ignore[no-untyped-def]
        plan = fill_token_budget(num_decodes, partials, [], budget, slots)
        left, admitted = budget - plan.num_batched_tokens, []
        for n in waiting:  # no chunking: a prompt joins only if it fits whole
            if len(admitted) == slots or n > left:
                break
            admitted.append(n)
            left -= n
        return plan.decodes, plan.partials, admitted + [0] * (len(waiting) - len(admitted))

    def ignores_slots(num_decodes, partials, waiting, budget, slots):  # type: ignore[no-untyped-def]
        return fill_token_budget(num_decodes, partials, waiting, budget, len(waiting))

    for bug in (prefills_first, whole_prompts_only, ignores_slots):
        result = check_fill_token_budget(bug)
        assert result.status == "failed" and result.failures, bug.__name__


def test_unstarted_stubs_fall_back_to_the_reference(capsys) -> None:  # type: ignore[no-untyped-def]
    def stub(*args):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    for check, reference in ((check_admit_fcfs, admit_fcfs), (check_fill_token_budget, fill_token_budget)):
        result = check(stub)
        assert result.status == "not started"
        assert use_or_reference(result, stub, reference) is reference
        assert "uses labkit's reference" in capsys.readouterr().out


def test_a_crashing_solution_is_reported() -> None:
    result = check_fill_token_budget(lambda *a: 1 / 0)
    assert result.status == "failed" and "ZeroDivisionError" in result.failures[0]
