"""Checkers for notebook 00 (``00_setup_and_hardware``).

Task 1 mirrors ``labkit.measure.hardware.attainable_flops``: the roofline.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from labkit.course import Check, CheckResult, Hints, run_checker

# (intensity FLOP/byte, peak FLOP/s, bandwidth bytes/s) -> attainable FLOP/s
ROOFLINE_CASES: list[tuple[float, float, float, float]] = [
    (1.0, 1e12, 100e9, 100e9),  # bandwidth-bound: 1 FLOP per byte at 100 GB/s
    (0.25, 1e12, 2e12, 0.5e12),  # decode-like intensity on a fast-memory GPU
    (50.0, 1e12, 100e9, 1e12),  # compute-bound: capped by the peak
    (10.0, 1e12, 100e9, 1e12),  # exactly at the ridge point
    (0.0, 1e12, 100e9, 0.0),  # no FLOPs at all
]


HINTS = Hints(
    concept="A step is limited by two roofs: how fast the device computes, and how fast memory feeds it. Which one "
            "binds for a step that does few operations per byte it reads?",
    rule="The attainable rate is the lower of the two: the compute roof, and the bandwidth times the step's "
         "arithmetic intensity (FLOPs per byte).",
    code="return min(peak_flops, bandwidth * intensity)",
    by_failure={"roof": "bandwidth times intensity is a rate in FLOP/s; a step can exceed neither roof"},
)


def check_attainable_flops(fn: Callable[[float, float, float], float]) -> CheckResult:
    """Task 1: ``fn(intensity, peak_flops, bandwidth)`` must follow the roofline."""

    def body(check: Check) -> None:
        for intensity, peak, bw, expected in ROOFLINE_CASES:
            got = fn(intensity, peak, bw)
            check.expect(
                isinstance(got, (int, float)) and math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-6),
                f"attainable_flops({intensity}, {peak:.3g}, {bw:.3g}) returned {got!r}, expected {expected:.4g}",
                because="roof",
            )

    return run_checker("Task 1 (attainable_flops)", "", body, task_id="00.attainable_flops")
