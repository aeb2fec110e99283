"""The direction the prose states, checked against the measurement and printed next to it.

A notebook's text says "continuous is faster" or "the throughput falls"; on a learner's busy laptop the
measurement may not agree. A ``Verdict`` is computed from the rounds: the claim *holds* when it held in every
round, is *contradicted* when the opposite held in every round, and is *too close to call* otherwise. Its text
gives the numbers it was computed from, and when the claim did not hold, the likely reason, so prose never
silently contradicts a plot. Introduced in notebook 03 (``03_kv_cache``).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from labkit.measure.rounds import Rounds

Outcome = Literal["holds", "contradicted", "too close to call"]
MARK = {"holds": "[holds]", "contradicted": "[does NOT hold here]", "too close to call": "[too close to call]"}
# Rounds within this fraction of each other are noise on a laptop, not a direction.
TIE = 0.02


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


def outcome_of(ratios: Sequence[float]) -> Outcome:
    """The claim's outcome from its round ratios (> 1: the claim's direction)."""
    if all(r > 1 + TIE for r in ratios):
        return "holds"
    if all(r < 1 - TIE for r in ratios):
        return "contradicted"
    return "too close to call"


def _explain(outcome: Outcome, why_not: str, rounds: Rounds | None) -> str:
    if outcome == "holds":
        return ""
    lines = []
    if outcome == "too close to call":
        lines.append("The rounds disagree (or differ by under 2%): the difference is within this machine's noise.")
    if why_not:
        lines.append(f"Likely reason: {why_not}")
    if rounds is not None and rounds.load is not None and rounds.load.busy:
        # the advice itself is printed once, by check_machine; repeating it after every verdict buries the figures
        lines.append(f"These rounds ran under load ({rounds.load.summary()}): close other programs and re-run.")
    return "\n   ".join([""] + lines)


def compare(rounds: Rounds, better: str, other: str, metric: str, higher_is_better: bool, claim: str,
            unit: str = "", fmt: str = ".1f", why_not: str = "") -> Verdict:
    """Check the claim "``better`` beats ``other`` on ``metric``" round by round."""
    a, b = rounds.get(better, metric), rounds.get(other, metric)
    ratios = [favour(x, y) if higher_is_better else favour(y, x) for x, y in zip(a, b)]
    outcome = outcome_of(ratios)
    med = statistics.median(ratios)
    spread = f"; rounds {min(ratios):.2f}x-{max(ratios):.2f}x"
    text = (f"{MARK[outcome]} {claim}: {better} {statistics.median(a):{fmt}} vs {other} "
            f"{statistics.median(b):{fmt}} {unit}".rstrip()
            + f" (median of {len(ratios)} rounds: {med:.2f}x in the claim's favour{spread})"
            + _explain(outcome, why_not, rounds))
    return Verdict(claim, outcome, med, (min(ratios), max(ratios)), text)


def trend(xs: Sequence[float], rounds_per_x: Sequence[Sequence[float]], expect: Literal["rises", "falls"],
          claim: str, x_label: str = "", unit: str = "", fmt: str = ".1f", why_not: str = "",
          rounds: Rounds | None = None) -> Verdict:
    """Check that a quantity rises (or falls) from the first x to the last: every round at the last x beyond every
    round at the first; the points in between are reported, not judged."""
    if len(xs) < 2 or len(xs) != len(rounds_per_x):
        raise ValueError(f"trend needs at least two x values with one list of rounds each, got {len(xs)} x values "
                         f"and {len(rounds_per_x)} lists")
    first, last = rounds_per_x[0], rounds_per_x[-1]
    sign = 1 if expect == "rises" else -1
    ratios = [favour(y, x) if sign > 0 else favour(x, y) for x in first for y in last]
    outcome = outcome_of(ratios)  # every (first round, last round) pair must agree
    medians = [statistics.median(r) for r in rounds_per_x]
    path = ", ".join(f"{x:g}{x_label}: {m:{fmt}}" for x, m in zip(xs, medians))
    steps = [b - a for a, b in zip(medians, medians[1:])]
    monotonic = all(s * sign > 0 for s in steps)
    bumpy = "" if monotonic or len(xs) == 2 else " (not at every step in between)"
    ranges = (f" (every round at {xs[-1]:g}{x_label} against every round at {xs[0]:g}{x_label}: "
              f"rounds {min(ratios):.2f}x-{max(ratios):.2f}x in the claim's favour)")
    text = (f"{MARK[outcome]} {claim}: medians {path} {unit}".rstrip() + bumpy + ranges
            + _explain(outcome, why_not, rounds))
    med = favour(medians[-1], medians[0]) if sign > 0 else favour(medians[0], medians[-1])
    return Verdict(claim, outcome, med, (min(ratios), max(ratios)), text)


def reaches(values: Sequence[float], target: float, claim: str, unit: str = "", fmt: str = ".2f", why_not: str = "",
            rounds: Rounds | None = None) -> Verdict:
    """Check that a quantity reaches ``target`` (a goal, a fraction of a roof) in every round."""
    if not values or target <= 0:
        raise ValueError(f"reaches needs at least one value and a positive target, got {len(values)} values and "
                         f"target {target}")
    ratios = [v / target for v in values]
    outcome = outcome_of(ratios)
    med = statistics.median(values)
    text = (f"{MARK[outcome]} {claim}: {med:{fmt}} {unit}".rstrip() + f" against {target:{fmt}} (median of "
            f"{len(values)} rounds: {med / target:.2f}x the target; rounds {min(ratios):.2f}x-{max(ratios):.2f}x)"
            + _explain(outcome, why_not, rounds))
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
    claim's direction), so a notebook's saved output can be checked without re-running it. A verdict on exact counts
    says "(exact"; a claim of two parts says "(both parts below)" and must hold only if both do.
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
        if re.search(r"\([^)]*\bexact\b", line):
            continue  # counted, not timed: the same in every round, nothing to audit against rounds
        pair = re.search(rf"rounds {_NUM}x-{_NUM}x", line)
        if not pair:
            problems.append(f"verdict without its round figures: {line.strip()}")
            continue
        low, high = float(pair[1]), float(pair[2])
        ok = {MARK["holds"]: low > 1 + TIE - slack, MARK["contradicted"]: high < 1 - TIE + slack,
              MARK["too close to call"]: low <= 1 + TIE + slack and high >= 1 - TIE - slack}[mark]
        if not ok:
            problems.append(f"mark {mark} disagrees with rounds {low:.3f}x-{high:.3f}x: {line.strip()}")
    return problems
