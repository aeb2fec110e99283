"""The direction the prose states, checked against the measurement and printed next to it.

A notebook's text says "continuous is faster" or "the throughput falls"; on a learner's busy laptop the
measurement may not agree. A ``Verdict`` is computed from the rounds: the claim *holds* when every round favoured it
by more than 2% **and** a one-sided t-test on the rounds' log ratios puts the effect beyond zero at the 5% level
(``labkit.measure.significance``); it is *contradicted* when the same is true the other way, and *too close to call*
otherwise. So on a null effect (no real difference) a verdict says "holds" at most 5% of the time, and "does NOT
hold" at most 5% of the time: "every round agreed" alone would say "holds" 1 time in 4 with 2 rounds (smoke mode)
and 1 time in 8 with 3. Its text gives the numbers it was computed from (the rounds' range and the test's p), and
when the claim did not hold, the likely reason, so prose never silently contradicts a plot. Introduced in notebook
03 (``03_kv_cache``); the false-alarm rate is stated in notebook 00 (``00_setup_and_hardware``).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from labkit.measure.rounds import Rounds
from labkit.measure.significance import ALPHA, capped_log, one_sample_t, p_one_sided, two_sample_t

Outcome = Literal["holds", "contradicted", "too close to call"]
MARK = {"holds": "[holds]", "contradicted": "[does NOT hold here]", "too close to call": "[too close to call]"}
# Rounds within this fraction of each other are noise on a laptop, not a direction.
TIE = 0.02
# A verdict's ``prediction`` left out (not asked for) is not the same as a learner's ``my_prediction = None``.
NOT_ASKED = object()
Prediction = float | str | None


def _predicted(prediction: object) -> str:
    """"; you predicted 3.5" (or "; no prediction recorded"), or "" when the notebook asked for none."""
    if prediction is NOT_ASKED:
        return ""
    if prediction is None or (isinstance(prediction, str) and not prediction.strip()):
        return "; no prediction recorded"
    if isinstance(prediction, float):
        return f"; you predicted {prediction:g}"
    return f"; you predicted {prediction}"


@dataclass(frozen=True)
class Verdict:
    """A claim from the prose and what the measurement says of it. Notebook 03."""

    claim: str
    outcome: Outcome
    ratio: float  # median over rounds of (claimed better) / (other), oriented so > 1 means the claim's direction
    ratio_range: tuple[float, float]
    text: str

    @property
    def holds(self) -> bool:
        return self.outcome == "holds"

    def __str__(self) -> str:
        return self.text


def favour(claimed_larger: float, other: float) -> float:
    """claimed_larger / other, where zeros mean what they say: 0 vs 0 is a tie (1.0), x vs 0 an infinite lead."""
    if other == 0:
        return 1.0 if claimed_larger == 0 else float("inf") if claimed_larger > 0 else 0.0
    return claimed_larger / other


def outcome_of(ratios: Sequence[float], test: tuple[float, int] | None = None) -> Outcome:
    """The claim's outcome from its round ratios (> 1: the claim's direction): every ratio beyond the 2% tie band
    and the t-test (``test``: (t, degrees of freedom); by default the one-sample test of the log ratios) significant
    at ``ALPHA`` in the same direction."""
    t, df = test if test is not None else one_sample_t([capped_log(r) for r in ratios])
    significant = p_one_sided(t, df) <= ALPHA
    if significant and t > 0 and all(r > 1 + TIE for r in ratios):
        return "holds"
    if significant and t < 0 and all(r < 1 - TIE for r in ratios):
        return "contradicted"
    return "too close to call"


def evidence(ratios: Sequence[float], test: tuple[float, int] | None = None) -> str:
    """The test's figure as every verdict prints it (and ``audit`` reads it back): "; p=0.012 (t-test, 5% bar)"."""
    t, df = test if test is not None else one_sample_t([capped_log(r) for r in ratios])
    return f"; p={p_one_sided(t, df):.3f} (t-test, {ALPHA:.0%} bar)"


def _explain(outcome: Outcome, why_not: str, rounds: Rounds | None) -> str:
    if outcome == "holds":
        return ""
    lines = []
    if outcome == "too close to call":
        lines.append("The rounds disagree, differ by under 2%, or vary too much for the 5% test (p above 0.05): "
                     "the difference is within this machine's noise.")
    if why_not:
        lines.append(f"Likely reason: {why_not}")
    if rounds is not None and rounds.load is not None and rounds.load.busy:
        # the advice itself is printed once, by check_machine; repeating it after every verdict buries the figures
        lines.append(f"These rounds ran under load ({rounds.load.summary()}): close other programs and re-run.")
    return "\n   ".join([""] + lines)


def compare(rounds: Rounds, better: str, other: str, metric: str, higher_is_better: bool, claim: str,
            unit: str = "", fmt: str = ".1f", why_not: str = "",
            prediction: Prediction | object = NOT_ASKED) -> Verdict:
    """Check the claim "``better`` beats ``other`` on ``metric``" round by round. ``prediction`` (the learner's,
    recorded before the measurement; None if they made none) is printed at the end of the verdict line."""
    a, b = rounds.get(better, metric), rounds.get(other, metric)
    ratios = [favour(x, y) if higher_is_better else favour(y, x) for x, y in zip(a, b)]
    outcome = outcome_of(ratios)
    med = statistics.median(ratios)
    spread = f"; rounds {min(ratios):.2f}x-{max(ratios):.2f}x" + evidence(ratios)
    text = (f"{MARK[outcome]} {claim}: {better} {statistics.median(a):{fmt}} vs {other} "
            f"{statistics.median(b):{fmt}} {unit}".rstrip()
            + f" (median of {len(ratios)} rounds: {med:.2f}x in the claim's favour{spread})"
            + _predicted(prediction) + _explain(outcome, why_not, rounds))
    return Verdict(claim, outcome, med, (min(ratios), max(ratios)), text)


def trend(xs: Sequence[float], rounds_per_x: Sequence[Sequence[float]], expect: Literal["rises", "falls"],
          claim: str, x_label: str = "", unit: str = "", fmt: str = ".1f", why_not: str = "",
          rounds: Rounds | None = None, prediction: Prediction | object = NOT_ASKED) -> Verdict:
    """Check that a quantity rises (or falls) from the first x to the last: every round at the last x beyond every
    round at the first; the points in between are reported, not judged. ``prediction``: as in ``compare``."""
    if len(xs) < 2 or len(xs) != len(rounds_per_x):
        raise ValueError(f"trend needs at least two x values with one list of rounds each, got {len(xs)} x values "
                         f"and {len(rounds_per_x)} lists")
    first, last = rounds_per_x[0], rounds_per_x[-1]
    sign = 1 if expect == "rises" else -1
    ratios = [favour(y, x) if sign > 0 else favour(x, y) for x in first for y in last]
    # every (first round, last round) pair must agree, and the two x values' log means differ beyond the 5% test
    test = two_sample_t([sign * capped_log(v) for v in first], [sign * capped_log(v) for v in last])
    outcome = outcome_of(ratios, test)
    medians = [statistics.median(r) for r in rounds_per_x]
    path = ", ".join(f"{x:g}{x_label}: {m:{fmt}}" for x, m in zip(xs, medians))
    steps = [b - a for a, b in zip(medians, medians[1:])]
    monotonic = all(s * sign > 0 for s in steps)
    bumpy = "" if monotonic or len(xs) == 2 else " (not at every step in between)"
    ranges = (f" (every round at {xs[-1]:g}{x_label} against every round at {xs[0]:g}{x_label}: "
              f"rounds {min(ratios):.2f}x-{max(ratios):.2f}x in the claim's favour{evidence(ratios, test)})")
    text = (f"{MARK[outcome]} {claim}: medians {path} {unit}".rstrip() + bumpy + ranges
            + _predicted(prediction) + _explain(outcome, why_not, rounds))
    med = favour(medians[-1], medians[0]) if sign > 0 else favour(medians[0], medians[-1])
    return Verdict(claim, outcome, med, (min(ratios), max(ratios)), text)


def reaches(values: Sequence[float], target: float, claim: str, unit: str = "", fmt: str = ".2f", why_not: str = "",
            rounds: Rounds | None = None, prediction: Prediction | object = NOT_ASKED) -> Verdict:
    """Check that a quantity reaches ``target`` (a goal, a fraction of a roof) in every round. ``prediction``: as in
    ``compare``."""
    if not values or target <= 0:
        raise ValueError(f"reaches needs at least one value and a positive target, got {len(values)} values and "
                         f"target {target}")
    ratios = [v / target for v in values]
    outcome = outcome_of(ratios)
    med = statistics.median(values)
    text = (f"{MARK[outcome]} {claim}: {med:{fmt}} {unit}".rstrip() + f" against {target:{fmt}} (median of "
            f"{len(values)} rounds: {med / target:.2f}x the target; rounds {min(ratios):.2f}x-{max(ratios):.2f}x"
            f"{evidence(ratios)})"
            + _predicted(prediction) + _explain(outcome, why_not, rounds))
    return Verdict(claim, outcome, med / target, (min(ratios), max(ratios)), text)


def signed_change(value: float, base: float, higher_is_better: bool, what: str) -> str:
    """'costs 12.2%' or 'gains 12.2%' of ``what``: the sign and the word agree (a cost is positive when worse)."""
    if base == 0:
        return f"{what}: no baseline to compare with"
    change = (value - base) / base * 100
    worse = change < 0 if higher_is_better else change > 0
    return f"{'costs' if worse else 'gains'} {abs(change):.1f}% of {what}"


_NUM = r"(inf|-?\d+(?:\.\d+)?)"


def audit(printed: str) -> list[str]:
    """Every printed verdict line whose mark disagrees with the numbers printed in it (empty: all consistent).

    Reads text as a notebook printed it (every verdict prints the range of its round ratios, oriented so > 1 is the
    claim's direction, and the one-sided t-test's "p=..."), so a notebook's saved output can be checked without
    re-running it: "[holds]" needs every round beyond the 2% band and p at most 5%; a line without a printed p is
    judged by its range alone. Only a verdict on exact *counts* ("(token counts: exact", "(step counts: exact") is
    not checked: a figure computed from measured inputs (a simulator fitted to timings, a model calibrated on this
    machine) must print its rounds like any measurement. A claim of two parts says "(both parts below)" and must
    hold only if both do.
    """
    problems = []
    slack = 0.01  # printed figures are rounded
    summary: tuple[str, str, list[str]] | None = None  # a "(both parts below)" line: its mark and its parts' marks
    for line in printed.splitlines() + [""]:
        mark = next((m for m in MARK.values() if line.lstrip().startswith(m)), None)
        if summary is not None and (mark is None or len(summary[2]) == 2):
            smark, sline, parts = summary
            want = (MARK["holds"] if parts and all(p == MARK["holds"] for p in parts) else
                    MARK["contradicted"] if MARK["contradicted"] in parts else MARK["too close to call"])
            if len(parts) != 2 or smark != want:
                problems.append(f"mark {smark} disagrees with its parts {parts}: {sline.strip()}")
            summary = None
        if mark is None:
            continue
        if "(both parts below)" in line:
            summary = (mark, line, [])
            continue
        if summary is not None:
            summary[2].append(mark)
        if re.search(r"\(\w+ counts: exact\b", line):
            continue  # counted, not timed: the same in every round, nothing to audit against rounds
        pair = re.search(rf"rounds {_NUM}x-{_NUM}x", line)
        if not pair:
            problems.append(f"verdict without its round figures: {line.strip()}")
            continue
        low, high = float(pair[1]), float(pair[2])
        p = re.search(r"\bp=(\d+\.\d+)", line)  # the test's p, as ``evidence`` prints it
        significant = p is None or float(p[1]) <= ALPHA + 0.0005  # printed to 3 decimals
        undecided = p is not None and float(p[1]) >= ALPHA - 0.0005
        ok = {MARK["holds"]: low > 1 + TIE - slack and significant,
              MARK["contradicted"]: high < 1 - TIE + slack and significant,
              MARK["too close to call"]: undecided or (low <= 1 + TIE + slack and high >= 1 - TIE - slack)}[mark]
        if not ok:
            test = f" and p={p[1]}" if p else ""
            problems.append(f"mark {mark} disagrees with rounds {low:.3f}x-{high:.3f}x{test}: {line.strip()}")
    return problems
