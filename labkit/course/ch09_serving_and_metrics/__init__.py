"""Checkers for notebook 09 (``09_serving_and_metrics``).

Task 1 mirrors ``labkit.measure.loadgen.metrics.request_goodput``: from per-request records (what the load
generator saw), SLOs in milliseconds and the run's duration in seconds, how many requests per second
met *every* SLO? The rules are vLLM's: only completed requests count; a request meets an SLO when its
value is <= the limit; TPOT is ``(E2EL - TTFT) / (output tokens - 1)`` and 0 for a single-token
request; SLOs not given are not checked.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence

from labkit.course import Check, CheckResult, Hints, run_checker
from labkit.measure.loadgen.metrics import RequestRecord, request_goodput

Goodput = Callable[[Sequence[RequestRecord], Mapping[str, float], float], float]


def record(ttft: float, latency: float, output_tokens: int, success: bool = True) -> RequestRecord:
    """A record with the given TTFT, E2EL (seconds) and output length; ITL gaps spread evenly."""
    gaps = output_tokens - 1
    itl = [(latency - ttft) / gaps] * gaps if success and gaps > 0 else []
    return RequestRecord(success=success, prompt_len=10, output_tokens=output_tokens, ttft=ttft, itl=itl,
                         latency=latency)


# Four requests over 2 s, worked out by hand (ms):   TTFT   TPOT                   E2EL
RUN = [record(0.100, 0.300, 5),  # A                   100    (300 - 100) / 4 = 50   300
       record(0.250, 0.250, 1),  # B: one token        250    0 (vLLM's rule)        250
       record(0.200, 0.400, 3),  # C                   200    (400 - 200) / 2 = 100  400
       record(0.050, 0.050, 0, success=False)]  # D: failed; never counts, however fast
GOODPUT_CASES: list[tuple[dict[str, float], float, float, str]] = [
    ({"ttft": 200}, 2.0, 1.0, "A and C meet TTFT <= 200 ms (C exactly at the limit counts); B does not"),
    ({"ttft": 199.9}, 2.0, 0.5, "only A is under 199.9 ms"),
    ({"tpot": 50}, 2.0, 1.0, "A's TPOT is exactly 50 ms; B has one token, so its TPOT counts as 0"),
    ({"tpot": 10}, 2.0, 0.5, "only B (TPOT 0) meets 10 ms"),
    ({"e2el": 300}, 4.0, 0.5, "A and B finish within 300 ms; divide by the duration (4 s), not the request count"),
    ({"ttft": 200, "tpot": 50}, 2.0, 0.5, "every SLO must hold: A only (C's TPOT is 100 ms)"),
    ({"ttft": 1000, "tpot": 1000, "e2el": 1000}, 0.5, 6.0, "all three completed requests; the failed one never"),
    ({"ttft": 10}, 2.0, 0.0, "nobody meets 10 ms"),
]


def random_cases(seed: int = 9, n: int = 100) -> list[tuple[list[RequestRecord], dict[str, float], float]]:
    """Seeded random runs and SLOs, answered by the reference (the same ones tests/ use)."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        records = []
        for _ in range(rng.randint(0, 12)):
            ttft = rng.uniform(0.01, 1.0)
            out = rng.choice([1, 1, 2, 5, 16, 64])
            records.append(record(ttft, ttft + (out - 1) * rng.uniform(0.005, 0.1), out, success=rng.random() > 0.1))
        slos = {k: rng.uniform(5, 1500) for k in ("ttft", "tpot", "e2el") if rng.random() < 0.6}
        cases.append((records, slos, rng.uniform(0.5, 20.0)))
    return cases


HINTS = Hints(
    concept="Goodput counts the requests that were worth serving. Which requests count, how many SLOs must each "
            "meet, and per what is the count expressed?",
    rule="Skip failed requests; a request counts when it meets every SLO given (a value at the limit meets it); "
         "the goodput is the number that count per second of the run.",
    code="sum(ok and ttft <= ttft_slo_ms / 1e3 and tpot <= tpot_slo_ms / 1e3 ... for each record) / duration, checking "
         "only the SLOs given",
    by_failure={"goodput": "a request counts only if it succeeded and met every SLO given; the result is per second"},
)


def check_goodput(fn: Goodput) -> CheckResult:
    """Task 1: ``fn(records, slos_ms, duration_s)`` returns requests meeting every SLO per second."""

    def body(check: Check) -> None:
        for slos, duration, want, why in GOODPUT_CASES:
            got = fn(list(RUN), dict(slos), duration)
            check.expect(isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12),
                         f"SLOs {slos} over {duration} s: got {got!r}, expected {want} ({why})", because="goodput")
        wrong = 0
        for records, slos, duration in random_cases():
            want = request_goodput(records, slos, duration)
            got = fn(list(records), dict(slos), duration)
            if not (isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12)):
                wrong += 1
                if wrong == 1:
                    check.expect(False, f"random run of {len(records)} requests, SLOs "
                                        f"{ {k: round(v, 1) for k, v in slos.items()} } ms, {duration:.2f} s: "
                                        f"got {got!r}, expected {want}", because="goodput")
        check.expect(wrong == 0, f"{wrong} of 100 random runs gave a different goodput from the reference",
                     because="goodput")

    return run_checker("Task 1 (request_goodput)", "", body, task_id="09.goodput")
