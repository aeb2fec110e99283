"""Checkers for notebook 10 (``10_profiling_host_overhead``).

Task 1 mirrors ``labkit.measure.profiling.trace_analysis.idle_fraction``: from a trace's device-work events
(Chrome trace events with a start ``ts`` and a duration ``dur``, in µs), the share of a time window in
which the device did nothing. Events overlap and nest (``aten::linear`` contains ``aten::addmm``; CUDA
streams can overlap), come in any order, and may stick out of the window: busy time is the length of
the *union* of the events inside the window, not the sum of their durations.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from labkit.course import Check, CheckResult, Hints, run_checker
from labkit.measure.profiling.trace_analysis import idle_fraction

IdleFraction = Callable[[Sequence[Mapping[str, Any]], float, float], float]


def _ev(start: float, end: float, name: str = "aten::op") -> dict[str, Any]:
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": float(start), "dur": float(end - start)}


# (events as (start, end) µs, window start, window end) -> idle fraction, worked out by hand
IDLE_CASES: list[tuple[list[tuple[float, float]], float, float, float, str]] = [
    ([(0, 40)], 0, 40, 0.0, "one event covers the whole window: never idle"),
    ([], 0, 40, 1.0, "no device work at all: idle the whole time"),
    ([(0, 10), (20, 30)], 0, 40, 0.5, "two separate events, 20 µs busy out of 40"),
    ([(0, 10), (2, 8)], 0, 20, 0.5, "nested events (aten::linear around aten::addmm): the inner one adds no busy time"),
    ([(0, 10), (5, 15)], 0, 20, 0.25, "overlapping events: busy from 0 to 15, not 10 + 10"),
    ([(20, 30), (0, 10), (8, 22)], 0, 40, 0.25, "out of order: sorted they chain into one busy stretch, 0 to 30"),
    ([(0, 10)], 5, 25, 0.75, "an event that started before the window counts only from the window's start"),
    ([(15, 40)], 0, 20, 0.75, "an event that ends after the window counts only until the window's end"),
    ([(30, 40), (-20, -5)], 0, 20, 1.0, "events entirely outside the window do not count"),
    ([(0, 10), (10, 20)], 0, 20, 0.0, "back-to-back events leave no gap"),
    ([(5, 5), (7, 7)], 0, 10, 1.0, "zero-length events (instants) are no work"),
    ([(100.5, 101.25), (101.0, 102.0), (103.0, 103.5)], 100, 104, 0.5,
     "fractional microseconds, as real traces have: busy 100.5-102 and 103-103.5"),
]


def random_cases(seed: int = 10, n: int = 200) -> list[tuple[list[tuple[float, float]], float, float]]:
    """Seeded random traces with nested, overlapping and out-of-window events (the same ones tests/ use)."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        events: list[tuple[float, float]] = []
        t = rng.uniform(-20, 20)
        for _ in range(rng.randint(0, 12)):
            start = t + rng.uniform(0, 15)
            end = start + rng.uniform(0, 25)
            events.append((start, end))
            if rng.random() < 0.4:  # a child op inside this one
                a = rng.uniform(start, end)
                events.append((a, rng.uniform(a, end)))
            t = start if rng.random() < 0.3 else end  # sometimes the next op overlaps this one
        rng.shuffle(events)
        lo = rng.uniform(-10, 60)
        cases.append((events, lo, lo + rng.uniform(1, 120)))
    return cases


HINTS = Hints(
    concept="Trace events overlap and nest, and some start before the window or end after it. How do you count a "
            "moment the device was busy exactly once?",
    rule="Clip each event to the window, merge events that overlap or nest, and add up the merged intervals: the "
         "idle fraction is the rest of the window.",
    code="intervals = sorted((max(ts, start), min(ts + dur, end)) ...); merge overlapping ones; busy = sum of their "
         "lengths; return 1 - busy / (end - start)",
    by_failure={"idle": "count each busy moment once: clip to the window, sort, and merge overlapping or nested "
                        "events"},
)


def check_idle_fraction(fn: IdleFraction) -> CheckResult:
    """Task 1: ``fn(events, start, end)`` returns the idle share of [start, end] in [0, 1]."""

    def body(check: Check) -> None:
        for spans, start, end, want, why in IDLE_CASES:
            got = fn([_ev(a, b) for a, b in spans], start, end)
            ok = isinstance(got, (int, float)) and math.isclose(got, want, abs_tol=1e-9)
            check.expect(ok, f"events {spans}, window [{start}, {end}]: got {got!r}, expected {want} ({why})",
                         because="idle")
        wrong = 0
        for spans, start, end in random_cases():
            want = idle_fraction([_ev(a, b) for a, b in spans], start, end)
            got = fn([_ev(a, b) for a, b in spans], start, end)
            if not (isinstance(got, (int, float)) and math.isclose(got, want, abs_tol=1e-9)):
                wrong += 1
                if wrong == 1:
                    check.expect(False, f"random case: events {[(round(a, 2), round(b, 2)) for a, b in spans]}, "
                                        f"window [{start:.2f}, {end:.2f}]: got {got!r}, expected {want:.6f}",
                                 because="idle")
        check.expect(wrong == 0, f"{wrong} of 200 random traces answered differently from the reference",
                     because="idle")

    return run_checker("Task 1 (idle_fraction)", "", body, task_id="10.idle_fraction")
