"""Verdicts: computed from the rounds, worded so the mark, the sign and the numbers agree."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from labkit.measure import Rounds, audit, compare, reaches, signed_change, trend
from labkit.measure.load import LoadReport


def _rounds(a: list[float], b: list[float], load: LoadReport | None = None) -> Rounds:
    r = Rounds(load=load)
    for x, y in zip(a, b):
        r.add("continuous", {"seconds": 1.0, "tok/s": x})
        r.add("static", {"seconds": 1.0, "tok/s": y})
    return r


def test_a_claim_that_held_in_every_round_holds() -> None:
    v = compare(_rounds([300, 320, 310], [100, 90, 110]), "continuous", "static", "tok/s", True,
                "continuous batching is faster", unit="tok/s")
    assert v.outcome == "holds" and v.holds
    assert v.text.startswith("[holds] continuous batching is faster: continuous 310.0 vs static 100.0 tok/s")
    assert v.ratio == pytest.approx(3.0) and v.ratio_range == pytest.approx((2.8181818, 3.5555555))
    assert "Likely reason" not in v.text


def test_a_contradicted_claim_says_so_and_why() -> None:
    busy = LoadReport(cpu_count=2, others_cores=1.0, load_avg_1m=2.0, sample_s=0.3)
    v = compare(_rounds([78, 80, 70], [84, 90, 85], load=busy), "continuous", "static", "tok/s", True,
                "continuous batching is faster", why_not="the static batch was already full")
    assert v.outcome == "contradicted" and not v.holds
    assert v.text.startswith("[does NOT hold here]")
    assert "Likely reason: the static batch was already full" in v.text
    assert "ran under load" in v.text and "close other programs" in v.text


def test_rounds_that_disagree_are_too_close_to_call() -> None:
    v = compare(_rounds([100, 80], [90, 90]), "continuous", "static", "tok/s", True, "faster")
    assert v.outcome == "too close to call"
    assert "within this machine's noise" in v.text
    tie = compare(_rounds([100, 101], [100, 100]), "continuous", "static", "tok/s", True, "faster")
    assert tie.outcome == "too close to call"  # 1% is noise, not a direction


def test_lower_is_better_metrics_are_oriented() -> None:
    r = Rounds()
    for a, b in [(10, 30), (12, 28)]:
        r.add("chunked", {"seconds": 1.0, "ttft_ms": a})
        r.add("continuous", {"seconds": 1.0, "ttft_ms": b})
    v = compare(r, "chunked", "continuous", "ttft_ms", False, "chunking cuts TTFT", unit="ms")
    assert v.holds and v.ratio > 2


def test_trend_checks_first_against_last_and_reports_bumps() -> None:
    falls = trend([0, 6, 8], [[300, 310], [250, 320], [200, 205]], "falls", "throughput falls with preemptions",
                  x_label=" preempt.")
    assert falls.holds and "(not at every step in between)" not in falls.text
    assert "0 preempt.: 305.0" in falls.text and "8 preempt.: 202.5" in falls.text
    rises = trend([0, 6, 8], [[300, 310], [250, 320], [200, 205]], "rises", "throughput rises")
    assert rises.outcome == "contradicted"
    bumpy = trend([1, 2, 3], [[10, 11], [40, 41], [20, 21]], "rises", "share rises")
    assert bumpy.holds and "(not at every step in between)" in bumpy.text
    overlap = trend([1, 32], [[38, 30], [31, 33]], "falls", "host share falls")
    assert overlap.outcome == "too close to call"
    with pytest.raises(ValueError, match="at least two x values"):
        trend([1], [[1.0]], "rises", "x")


def test_signed_change_words_match_signs() -> None:
    # the example: caching on (592 tok/s) slower than off (719): a cost, positive
    assert signed_change(592, 719, higher_is_better=True, what="throughput") == "costs 17.7% of throughput"
    assert signed_change(800, 719, higher_is_better=True, what="throughput") == "gains 11.3% of throughput"
    assert signed_change(120, 100, higher_is_better=False, what="TTFT").startswith("costs 20.0%")


@given(st.floats(1, 1e4), st.floats(1, 1e4), st.booleans())
def test_signed_change_word_agrees_with_direction(value: float, base: float, higher_is_better: bool) -> None:
    text = signed_change(value, base, higher_is_better, "x")
    worse = value < base if higher_is_better else value > base
    assert text.startswith("costs" if worse else "gains")


def test_audit_accepts_what_compare_and_trend_print_and_catches_a_planted_mismatch() -> None:
    lines = [
        compare(_rounds([300, 320, 310], [100, 90, 110]), "continuous", "static", "tok/s", True, "faster").text,
        compare(_rounds([78, 80, 70], [84, 90, 85]), "continuous", "static", "tok/s", True, "faster").text,
        compare(_rounds([100, 80], [90, 90]), "continuous", "static", "tok/s", True, "faster").text,
        trend([0, 8], [[300, 310], [200, 205]], "falls", "throughput falls").text,
        trend([1, 32], [[38, 30], [31, 33]], "falls", "host share falls").text,
        "[PASS] Task 1: a check line, not a verdict",
    ]
    printed = "\n".join(lines)
    assert audit(printed) == []
    planted = printed.replace("[does NOT hold here]", "[holds]", 1)
    problems = audit(planted)
    assert len(problems) == 1 and "disagrees with rounds 0.820x-0.930x" in problems[0]
    assert audit("[too close to call] faster: rounds 1.50x-1.60x") != []
    assert audit("[holds] faster, trust me") == ["verdict without its round figures: [holds] faster, trust me"]


def test_audit_skips_exact_counts_and_checks_two_part_claims_against_their_parts() -> None:
    assert audit("[holds] the useful share falls: 100% -> 54% (token counts: exact, the same in every round)") == []
    two = ("[too close to call] a two-part claim (both parts below):\n"
           "   [holds] part one (rounds 1.20x-1.30x of the bar)\n"
           "   [too close to call] part two (rounds 0.90x-1.40x in the claim's favour)")
    assert audit(two) == []
    assert audit(two.replace("[too close to call] a two", "[holds] a two")) != []


def test_zeros_are_a_tie_not_a_win() -> None:
    """Two systems that both served nothing within the SLOs: no direction (once printed as an infinite win)."""
    r = Rounds()
    for a, b in [(0.0, 0.0), (0.0, 0.0)]:
        r.add("disaggregated", {"seconds": 1.0, "goodput": a})
        r.add("chunked", {"seconds": 1.0, "goodput": b})
    v = compare(r, "disaggregated", "chunked", "goodput", True, "more requests within the SLOs")
    assert v.outcome == "too close to call" and audit(v.text) == []
    r.add("x", {"seconds": 1.0, "goodput": 2.0})
    r.add("x", {"seconds": 1.0, "goodput": 3.0})
    win = compare(r, "x", "chunked", "goodput", True, "x serves more")
    assert win.holds and "rounds infx-infx" in win.text and audit(win.text) == []
    lose = compare(r, "chunked", "x", "goodput", True, "chunked serves more")
    assert lose.outcome == "contradicted" and audit(lose.text) == []


def test_reaches_judges_every_round_against_the_target_and_audits_clean() -> None:
    held = reaches([0.91, 0.86, 1.02], 0.80, "the step reaches 0.80 of the roof", unit="of the roof")
    assert held.holds and held.text.startswith("[holds] the step reaches 0.80 of the roof: 0.91 of the roof")
    assert "rounds 1.07x-1.27x" in held.text
    # two rounds must agree closely for the 5% test (t > 6.31 on 1 df): 0.61 and 0.70 of the roof would not
    missed = reaches([0.61, 0.63], 0.80, "the step reaches 0.80 of the roof", why_not="another process held a core")
    assert missed.outcome == "contradicted" and "Likely reason: another process held a core" in missed.text
    close = reaches([0.79, 0.85], 0.80, "the step reaches 0.80 of the roof")
    assert close.outcome == "too close to call"
    assert audit("\n".join(v.text for v in (held, missed, close))) == []
    planted = held.text.replace("[holds]", "[does NOT hold here]")
    assert audit(planted)  # a mark that disagrees with its rounds is caught
    with pytest.raises(ValueError, match="positive target"):
        reaches([1.0], 0.0, "nothing")
