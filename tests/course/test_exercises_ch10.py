"""The checker of notebook 10 passes labkit's reference, fails planted bugs, and reports an unstarted stub."""

from __future__ import annotations

import pytest

from labkit.course import use_or_reference
from labkit.course.ch10_profiling_host_overhead import IDLE_CASES, _ev, check_idle_fraction, random_cases
from labkit.measure.profiling.trace_analysis import idle_fraction


def test_ch10_idle_fraction_checker_passes_the_reference() -> None:
    result = check_idle_fraction(idle_fraction)
    assert result.passed, result.message()


def test_ch10_hand_cases_agree_with_the_reference() -> None:
    # The hand-made answers are independent of the reference; both must agree (a wrong expectation fails here).
    for spans, start, end, want, why in IDLE_CASES:
        assert idle_fraction([_ev(a, b) for a, b in spans], start, end) == pytest.approx(want, abs=1e-12), why


def test_ch10_random_cases_cover_the_hard_parts() -> None:
    cases = random_cases()
    assert len(cases) == 200
    # nested or overlapping events, and events sticking out of the window, occur often enough to be tested
    overlapping = sum(any(a2 < b1 and a1 < b2 for i, (a1, b1) in enumerate(ev) for (a2, b2) in ev[i + 1:])
                      for ev, _, _ in cases)
    sticking_out = sum(any(a < lo < b or a < hi < b for a, b in ev) for ev, lo, hi in cases)
    assert overlapping > 50 and sticking_out > 50
    values = [idle_fraction([_ev(a, b) for a, b in ev], lo, hi) for ev, lo, hi in cases]
    assert all(0.0 <= v <= 1.0 for v in values)
    assert sum(v == 1.0 for v in values) < 100 and sum(0 < v < 1 for v in values) > 50  # not trivial answers


def test_ch10_reference_rejects_an_empty_window() -> None:
    with pytest.raises(ValueError, match="end > start"):
        idle_fraction([], 5.0, 5.0)


def test_ch10_idle_fraction_checker_fails_planted_bugs() -> None:
    def sums_durations(events, start, end):  # type: ignore[no-untyped-def]
        return 1 - sum(e["dur"] for e in events) / (end - start)  # nested ops counted twice; no clipping

    def no_clipping(events, start, end):  # type: ignore[no-untyped-def]
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
        merged: list[list[float]] = []
        for a, b in spans:
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        busy = sum(b - a for a, b in merged if b > start and a < end)  # whole events, even parts outside
        return 1 - busy / (end - start)

    def merges_in_given_order(events, start, end):  # type: ignore[no-untyped-def]
        merged: list[list[float]] = []
        for e in events:  # forgets to sort: only neighbours in file order are merged
            a, b = max(e["ts"], start), min(e["ts"] + e["dur"], end)
            if b <= a:
                continue
            if merged and a <= merged[-1][1] and b >= merged[-1][0]:
                merged[-1] = [min(a, merged[-1][0]), max(b, merged[-1][1])]
            else:
                merged.append([a, b])
        return 1 - sum(b - a for a, b in merged) / (end - start)

    def busy_not_idle(events, start, end):  # type: ignore[no-untyped-def]
        return 1 - idle_fraction(events, start, end)

    def drops_partial_events(events, start, end):  # type: ignore[no-untyped-def]
        inside = [e for e in events if e["ts"] >= start and e["ts"] + e["dur"] <= end]
        return idle_fraction(inside, start, end)

    for bug in (sums_durations, no_clipping, merges_in_given_order, busy_not_idle, drops_partial_events):
        result = check_idle_fraction(bug)
        assert result.status == "failed" and result.failures, bug.__name__


def test_unstarted_stub_falls_back_to_the_reference(capsys) -> None:  # type: ignore[no-untyped-def]
    def stub(events, start, end):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    result = check_idle_fraction(stub)
    assert result.status == "not started"
    chosen = use_or_reference(result, stub, idle_fraction)
    assert chosen is idle_fraction
    assert "reference" in capsys.readouterr().out
