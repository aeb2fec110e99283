"""Checkers for notebook 08 (``08_chunked_prefill``).

Task 1 mirrors ``labkit.engine.sched.policy.fill_token_budget``: the budget-filling policy of the
``chunked`` engine's scheduler (Sarathi-Serve, vLLM's default): decodes first, then the next chunk of
each partial prefill, then waiting prompts FCFS, each prefill taking min(tokens left, budget left).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from labkit.exercises import Check, CheckResult, run_checker
from labkit.engine.sched.policy import fill_token_budget

FillBudget = Callable[[int, Sequence[int], Sequence[int], int, int], Any]

# (decodes, partial prefills, waiting, budget, free slots) -> (decodes, partials, waiting), worked out by hand
BUDGET_CASES: list[tuple[int, list[int], list[int], int, int, tuple[list[int], list[int], list[int]], str]] = [
    (3, [], [100], 64, 4, ([1, 1, 1], [], [61]),
     "three decodes take 3 tokens; the new prompt gets a first chunk of 61"),
    (0, [], [20, 30, 50], 64, 4, ([], [], [20, 30, 14]), "short prompts whole, the last one chunked to the 14 left"),
    (2, [40], [10], 32, 4, ([1, 1], [30], [0]), "the partial prefill takes the 30 left; nothing for the waiting one"),
    (5, [], [8], 4, 4, ([1, 1, 1, 1, 0], [], [0]), "a budget smaller than the decodes: the first four decode"),
    (1, [5, 5], [5, 5], 100, 1, ([1], [5, 5], [5, 0]), "one free slot: only one waiting request may join"),
    (0, [], [10, 10], 100, 0, ([], [], [0, 0]), "no free slot: nobody joins"),
    (2, [3], [4, 100, 1], 10, 8, ([1, 1], [3], [4, 1, 0]), "10 = 2 decodes + 3 + 4 + a 1-token chunk of the long one"),
    (0, [600], [], 512, 4, ([], [512], []), "a long partial prefill is cut to the budget"),
    (4, [], [], 512, 4, ([1, 1, 1, 1], [], []), "decodes only"),
]


def _as_lists(result: Any) -> tuple[list[int], list[int], list[int]]:
    if isinstance(result, dict):
        return list(result["decodes"]), list(result["partials"]), list(result["waiting"])
    decodes, partials, waiting = result
    return list(decodes), list(partials), list(waiting)


def random_cases(seed: int = 8, n: int = 200) -> list[tuple[int, list[int], list[int], int, int]]:
    """Seeded random situations, answered by the reference (the same ones tests/ use)."""
    rng = random.Random(seed)
    return [(rng.randint(0, 12), [rng.randint(2, 900) for _ in range(rng.randint(0, 2))],
             [rng.randint(1, 900) for _ in range(rng.randint(0, 4))], rng.choice([8, 16, 32, 64, 128, 256, 512]),
             rng.randint(0, 4)) for _ in range(n)]


def check_fill_token_budget(fn: FillBudget) -> CheckResult:
    """Task 1: ``fn(num_decodes, partial_prefills, waiting, token_budget, num_free_slots)`` returns
    (decodes, partials, waiting): the tokens each computes this step, as three lists."""

    def body(check: Check) -> None:
        for decodes, partials, waiting, budget, slots, want, why in BUDGET_CASES:
            got = _as_lists(fn(decodes, list(partials), list(waiting), budget, slots))
            check.expect(got == want, f"decodes={decodes}, partials={partials}, waiting={waiting}, budget={budget}, "
                                      f"free slots={slots}: got {got}, expected {want} ({why})")
        wrong = 0
        for decodes, partials, waiting, budget, slots in random_cases():
            want = tuple(fill_token_budget(decodes, partials, waiting, budget, slots))
            got = _as_lists(fn(decodes, list(partials), list(waiting), budget, slots))
            if got != want:
                wrong += 1
                if wrong == 1:
                    check.expect(False, f"random case decodes={decodes}, partials={partials}, waiting={waiting}, "
                                        f"budget={budget}, free slots={slots}: got {got}, expected {list(want)}")
        check.expect(wrong == 0, f"{wrong} of 200 random situations answered differently from the scheduler's rule")

    return run_checker(
        "Task 1 (fill_token_budget)",
        "give every decode 1 token while budget lasts; then each partial prefill min(left, budget); then admit "
        "waiting prompts in order while a slot and budget remain, each min(prompt, budget); return 0 for the rest.",
        body,
    )
