"""Checkers for notebook 01 (``01_anatomy_of_a_request``).

Task 1 mirrors ``labkit.core.metrics.compute_latencies``: TTFT, ITL, TPOT and E2E from timestamps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from labkit.course import Check, CheckResult, Hints, run_checker

# (arrival_time, token_times) timelines with hand-computed answers (ttft, itl, tpot, e2e)
LATENCY_CASES: list[tuple[float, list[float], tuple[float, list[float], float, float]]] = [
    (0.0, [0.5, 0.6, 0.7, 0.8], (0.5, [0.1, 0.1, 0.1], 0.1, 0.8)),
    (10.0, [10.2, 10.3, 10.9], (0.2, [0.1, 0.6], 0.35, 0.9)),  # one stall: ITL shows it, TPOT averages it
    (1.0, [3.0], (2.0, [], 0.0, 2.0)),  # a single output token: no gaps, TPOT 0
    (5.0, [5.0, 6.0], (0.0, [1.0], 1.0, 1.0)),
]


def _field(result: Any, name: str) -> Any:
    return result[name] if isinstance(result, dict) else getattr(result, name)


HINTS = Hints(
    concept="A user waits for the first token, then reads the others as they stream. Which waits does each latency "
            "measure, and from which moment does the clock start?",
    rule="TTFT and E2E count from the request's arrival to the first and the last token; ITL is every gap between "
         "two consecutive tokens; TPOT spreads the time after the first token over the tokens after the first.",
    code="ttft = t[0] - arrival; e2e = t[-1] - arrival; itl = [b - a for a, b in zip(t, t[1:])]; tpot = (e2e - "
         "ttft) / (n - 1) if n > 1 else 0.0",
    by_failure={
        "ttft": "the time to first token counts from the request's arrival, not from the start of its prefill",
        "itl": "there is one inter-token gap between each two consecutive tokens",
        "tpot": "the time per output token spreads the time after the first token over the tokens after the first",
        "e2e": "the end-to-end latency counts from the arrival to the last token",
    },
)


def check_request_latencies(fn: Callable[[float, list[float]], Any]) -> CheckResult:
    """Task 1: ``fn(arrival_time, token_times)`` returns ttft, itl, tpot, e2e (a dict or an object)."""

    def close(a: float, b: float) -> bool:
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)

    def body(check: Check) -> None:
        for arrival, times, (ttft, itl, tpot, e2e) in LATENCY_CASES:
            got = fn(arrival, list(times))
            label = f"arrival={arrival}, token_times={times}"
            check.expect(close(_field(got, "ttft"), ttft), f"{label}: ttft={_field(got, 'ttft')!r}, expected {ttft}",
                         because="ttft")
            got_itl = list(_field(got, "itl"))
            check.expect(len(got_itl) == len(itl) and all(close(a, b) for a, b in zip(got_itl, itl)),
                         f"{label}: itl={got_itl!r}, expected {itl}", because="itl")
            check.expect(close(_field(got, "tpot"), tpot), f"{label}: tpot={_field(got, 'tpot')!r}, expected {tpot}",
                         because="tpot")
            check.expect(close(_field(got, "e2e"), e2e), f"{label}: e2e={_field(got, 'e2e')!r}, expected {e2e}",
                         because="e2e")

    return run_checker("Task 1 (request_latencies)", "", body, task_id="01.request_latencies")

