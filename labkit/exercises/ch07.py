"""Checkers for notebook 07 (``07_continuous_batching``).

Task 1 mirrors ``labkit.engine.sched.policy.admit_fcfs``: the admission rule of the ``continuous``
engine's scheduler. Given the free slots, the token budget left after this step's decodes, the free KV
blocks, and each waiting request's needs (tokens, blocks) in queue order, which requests join this step?
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from labkit.exercises import Check, CheckResult, run_checker
from labkit.engine.sched.policy import admit_fcfs

Admit = Callable[[Sequence[tuple[int, int]], int, int, int], Sequence[int]]

# (waiting [(tokens, blocks)], free slots, token budget, free blocks) -> indices admitted, worked out by hand
ADMISSION_CASES: list[tuple[list[tuple[int, int]], int, int, int, list[int], str]] = [
    ([(10, 1), (20, 2), (30, 2)], 4, 100, 10, [0, 1, 2], "everything fits"),
    ([(10, 1), (20, 2), (30, 2)], 2, 100, 10, [0, 1], "only two free slots"),
    ([(60, 4), (50, 4), (5, 1)], 4, 100, 10, [0], "the 50-token prompt exceeds the 40 tokens left; the small one "
                                                   "behind it must not jump the queue (FCFS)"),
    ([(10, 1), (20, 5), (5, 1)], 4, 100, 5, [0], "the second request needs 5 blocks but only 4 are left; FCFS stops"),
    ([(100, 7)], 4, 100, 7, [0], "a prompt exactly the size of the budget and of the free blocks fits"),
    ([(101, 7)], 4, 100, 7, [], "a prompt one token over the budget waits (prompts are prefilled whole)"),
    ([], 4, 100, 10, [], "nobody waiting"),
    ([(10, 1)], 0, 100, 10, [], "no free slot"),
    ([(16, 1), (16, 1), (16, 1)], 3, 40, 10, [0, 1],
     "each admission uses up budget: 16 + 16 fit in 40, a third does not"),
    ([(16, 2), (16, 2), (16, 2)], 3, 100, 5, [0, 1], "each admission uses up blocks: 2 + 2 fit in 5, a third does not"),
]


def random_cases(seed: int = 7, n: int = 200) -> list[tuple[list[tuple[int, int]], int, int, int]]:
    """Seeded random situations, answered by the reference (the same ones tests/ use)."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        waiting = []
        for _ in range(rng.randint(0, 6)):
            tokens = rng.randint(1, 300)
            waiting.append((tokens, -(-tokens // 16)))
        cases.append((waiting, rng.randint(0, 5), rng.randint(0, 600), rng.randint(0, 40)))
    return cases


def check_admit_fcfs(fn: Admit) -> CheckResult:
    """Task 1: ``fn(waiting, num_free_slots, token_budget, num_free_blocks)`` returns the indices admitted."""

    def body(check: Check) -> None:
        for waiting, slots, budget, blocks, want, why in ADMISSION_CASES:
            got = list(fn(list(waiting), slots, budget, blocks))
            check.expect(got == want, f"waiting={waiting}, free slots={slots}, budget={budget}, free blocks="
                                      f"{blocks}: got {got}, expected {want} ({why})")
        wrong = 0
        for waiting, slots, budget, blocks in random_cases():
            want = admit_fcfs(waiting, slots, budget, blocks)
            got = list(fn(list(waiting), slots, budget, blocks))
            if got != want:
                wrong += 1
                if wrong == 1:
                    check.expect(False, f"random case waiting={waiting}, free slots={slots}, budget={budget}, free "
                                        f"blocks={blocks}: got {got}, expected {want}")
        check.expect(wrong == 0, f"{wrong} of 200 random situations answered differently from the scheduler's rule")

    return run_checker(
        "Task 1 (admit_fcfs)",
        "walk the queue in order; stop (break, not skip) at the first request lacking a slot, budget "
        "(tokens <= budget left) or blocks (blocks <= blocks left); subtract what each admitted request takes.",
        body,
    )
