"""Notebook 12's second Build task, the placement search: the checker passes labkit's search and fails each planted
mistake with a message naming it (and the hint for its class, never the code)."""

from __future__ import annotations

import pytest

from labkit.course.ch12_disaggregated_prefill import PLACEMENT_HINTS, check_placement
from labkit.measure.sim.placement import choose_placement, units


def forgets_colocation(max_devices, goodput):  # type: ignore[no-untyped-def]
    splits = [(p, d) for p, d in units(max_devices) if p > 0]  # BUG: (0, n) never considered
    return max(splits, key=lambda u: (goodput(*u) / sum(u), -sum(u)))


def total_not_per_device(max_devices, goodput):  # type: ignore[no-untyped-def]
    return max(units(max_devices), key=lambda u: (goodput(*u), -sum(u)))  # BUG: req/s, not req/s per device


def only_whole_cluster(max_devices, goodput):  # type: ignore[no-untyped-def]
    full = [(0, max_devices)] + [(p, max_devices - p) for p in range(1, max_devices)]  # BUG: no smaller unit
    return max(full, key=lambda u: goodput(*u) / sum(u))


def asks_for_no_decode(max_devices, goodput):  # type: ignore[no-untyped-def]
    every = [(p, n - p) for n in range(1, max_devices + 1) for p in range(0, n + 1)]  # BUG: includes (n, 0)
    return max(every, key=lambda u: (goodput(*u) / sum(u), -sum(u)))


def largest_on_a_tie(max_devices, goodput):  # type: ignore[no-untyped-def]
    return max(units(max_devices), key=lambda u: (goodput(*u) / sum(u), sum(u)))  # BUG: the bigger unit on a tie


def returns_a_list(max_devices, goodput):  # type: ignore[no-untyped-def]
    return list(choose_placement(max_devices, goodput))


def test_checker_passes_labkits_search() -> None:
    result = check_placement(choose_placement)
    assert result.passed, result.message()


@pytest.mark.parametrize("bug, message, because", [
    (forgets_colocation, "never looked at colocated units", "colocated"),
    (total_not_per_device, "more req/s in total, fewer per device", "per-device"),
    (only_whole_cluster, "more req/s in total, fewer per device", "per-device"),
    (asks_for_no_decode, "needs a decode worker", "invalid"),
    (largest_on_a_tie, "a tie per device", "tie"),
    (returns_a_list, "must return a tuple (P, D)", "returns"),
])
def test_checker_fails_planted_bugs(bug, message: str, because: str) -> None:  # type: ignore[no-untyped-def]
    result = check_placement(bug)
    assert result.status == "failed" and message in result.failures[0], result.message()
    printed = result.message()
    assert PLACEMENT_HINTS.by_failure[because] in printed and PLACEMENT_HINTS.code not in printed


def test_a_stub_is_not_started() -> None:
    def choose(max_devices, goodput):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    assert check_placement(choose).status == "not started"


def test_units_are_every_placement_that_fits() -> None:
    assert list(units(3)) == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (2, 1)]
    with pytest.raises(ValueError, match="at least one device"):
        list(units(0))
