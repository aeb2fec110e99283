"""How sure a verdict is: a one-sided t-test on the log ratios of the rounds, with a 5% false-alarm rate.

"Every round favoured the claim" is weak evidence when there are few rounds: with no real difference, each round
is a coin toss, so two rounds agree by chance 1 time in 4 and three rounds 1 time in 8. A verdict therefore also asks
Student's t-test whether the rounds' mean log ratio is beyond zero. Logs, because a ratio's noise is multiplicative
(0.5x and 2x are equally far from a tie) and a log ratio is a difference of log times. The test is one-sided in the
direction the rounds point, at ``ALPHA`` = 5%: on a null effect (the two contenders equally fast, the rounds
independent with roughly normal log-ratio noise) it says "beyond zero" at most 5% of the time, in each direction.
With 2 rounds (smoke mode) the t statistic must exceed 6.31, with 3 rounds 2.92: the rounds must not only agree but
agree closely. Used by ``labkit.measure.verdict``; introduced in notebook 03 (``03_kv_cache``), the rate stated in
notebook 00 (``00_setup_and_hardware``).

Student's t distribution is computed from its closed form for integer degrees of freedom (Abramowitz and Stegun,
26.7.3-26.7.4), so nothing beyond the standard library is needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

ALPHA = 0.05  # the largest false-alarm rate a verdict may have on a null effect, in each direction
# A ratio of 0 or infinity (one side served nothing) counts as this lead, so that the logs stay finite.
CAP = 1e6


def capped_log(ratio: float) -> float:
    """log(ratio), with 0 and infinity counted as a lead of ``CAP`` times."""
    return math.log(min(max(ratio, 1 / CAP), CAP))


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with ``df`` (integer, >= 1) degrees of freedom."""
    if df < 1:
        raise ValueError(f"Student's t needs at least 1 degree of freedom, got {df}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    # A = P(|T| < |t|) as a finite series in cos^2(theta): odd and even degrees of freedom differ
    term, total = 1.0, 1.0
    if df % 2 == 1:
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        inside = 2 / math.pi * (theta + (math.sin(theta) * math.cos(theta) * total if df > 1 else 0.0))
    else:
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        inside = math.sin(theta) * total
    return 0.5 + math.copysign(inside / 2, t)


def one_sample_t(logs: Sequence[float]) -> tuple[float, int]:
    """(t, degrees of freedom) of the mean of ``logs`` against 0; t is +-inf when every value is the same non-zero
    number, 0 with fewer than two values (nothing to test)."""
    n = len(logs)
    if n < 2:
        return 0.0, max(n - 1, 1)
    mean = sum(logs) / n
    var = sum((x - mean) ** 2 for x in logs) / (n - 1)
    return _t(mean, math.sqrt(var / n)), n - 1


def two_sample_t(first: Sequence[float], last: Sequence[float]) -> tuple[float, int]:
    """(t, degrees of freedom) of mean(last) - mean(first), pooled variance: for rounds taken at two different x
    values (a trend), where no round pairs with another."""
    n1, n2 = len(first), len(last)
    if n1 < 1 or n2 < 1 or n1 + n2 < 3:
        return 0.0, 1
    m1, m2 = sum(first) / n1, sum(last) / n2
    ss = sum((x - m1) ** 2 for x in first) + sum((x - m2) ** 2 for x in last)
    df = n1 + n2 - 2
    return _t(m2 - m1, math.sqrt(ss / df * (1 / n1 + 1 / n2))), df


def _t(effect: float, se: float) -> float:
    if se > 0:
        return effect / se
    return 0.0 if effect == 0 else math.copysign(math.inf, effect)


def p_one_sided(t: float, df: int) -> float:
    """The chance of a t at least this far from 0, on this side, when there is no effect."""
    return 1 - t_cdf(abs(t), df)
