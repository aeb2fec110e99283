"""Verdicts on simulated noise: on a null effect "[holds]" (and "[does NOT hold here]") comes up at most 5% of the
time, while a real effect is still detected; the t distribution behind the test is right.

Each comparison is what a notebook does: two contenders timed in every round, each round's time multiplied by noise
(log-normal, or heavy-tailed: Student t with 3 degrees of freedom on the log), a shared drift per round (the machine
speeding up or slowing down hits both contenders), and ``compare`` / ``trend`` / ``reaches`` computing the verdict.
The seed is fixed, so the counts are the same on every run; the bound allows three binomial standard errors of
sampling error on top of 5%, far below what the old rule ("every round agreed") gives on the same draws (1 in 4 with
two rounds, 1 in 8 with three), which the test also checks, so the test fails if the statistics are taken out.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from labkit.measure import Rounds, audit, compare, reaches, trend
from labkit.measure.significance import ALPHA, one_sample_t, p_one_sided, t_cdf, two_sample_t
from labkit.measure.verdict import TIE

TRIALS = 6000
BOUND = ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / TRIALS)  # 5% plus three standard errors of the estimate


def _noise(rng: np.random.Generator, sd: float, shape: tuple[int, ...], heavy: bool) -> np.ndarray:
    return (rng.standard_t(3, size=shape) if heavy else rng.normal(size=shape)) * sd


def _null_compares(num_rounds: int, sd: float, heavy: bool, seed: int) -> tuple[float, float, float]:
    """Shares of "holds", "does NOT hold" and "every round favoured the claim by > 2%" (the old rule) when the two
    contenders are equally fast."""
    rng = np.random.default_rng(seed)
    holds = contradicted = every_round = 0
    for _ in range(TRIALS):
        drift = rng.normal(scale=0.3, size=num_rounds)  # the machine's speed that round: both pay it
        times = np.exp(drift + _noise(rng, sd, (2, num_rounds), heavy))
        r = Rounds()
        for a, b in times.T:
            r.add("new", {"seconds": float(a)})
            r.add("old", {"seconds": float(b)})
        v = compare(r, "new", "old", "seconds", higher_is_better=False, claim="new is faster")
        holds += v.outcome == "holds"
        contradicted += v.outcome == "contradicted"
        every_round += all(x > 1 + TIE for x in r.ratios("old", "new"))
    return holds / TRIALS, contradicted / TRIALS, every_round / TRIALS


@pytest.mark.parametrize("num_rounds", [2, 3])  # smoke mode and full size (labkit.measure.default_rounds)
@pytest.mark.parametrize("heavy", [False, True], ids=["normal", "heavy-tailed"])
@pytest.mark.parametrize("sd", [0.05, 0.3])
def test_a_null_comparison_holds_at_most_5_percent_of_the_time(num_rounds: int, heavy: bool, sd: float) -> None:
    holds, contradicted, every_round = _null_compares(num_rounds, sd, heavy, seed=33 + num_rounds)
    assert holds <= BOUND and contradicted <= BOUND, (holds, contradicted)
    if sd >= 0.3:  # noise well beyond the 2% band: the old rule alone, a coin toss per round, fails this bound
        assert every_round > BOUND, every_round


def test_a_null_trend_and_a_null_target_hold_at_most_5_percent_of_the_time() -> None:
    rng = np.random.default_rng(7)
    trend_holds = reach_holds = reach_missed = 0
    for _ in range(TRIALS):
        first, last = np.exp(_noise(rng, 0.2, (2, 3), heavy=False))
        trend_holds += trend([1, 32], [list(first), list(last)], "rises", "x rises").outcome == "holds"
        values = np.exp(_noise(rng, 0.2, (3,), heavy=False))  # centred on the target: it is reached half the time
        outcome = reaches(list(values), 1.0, "reaches the goal").outcome
        reach_holds += outcome == "holds"
        reach_missed += outcome == "contradicted"
    assert max(trend_holds, reach_holds, reach_missed) / TRIALS <= BOUND


@pytest.mark.parametrize(("num_rounds", "effect", "sd", "power"),
                         [(3, 1.2, 0.05, 0.8), (3, 1.5, 0.1, 0.8), (2, 2.0, 0.05, 0.8), (2, 1.3, 0.02, 0.8)])
def test_a_real_effect_is_still_detected(num_rounds: int, effect: float, sd: float, power: float) -> None:
    """``effect``: how many times faster the claim's side is; ``sd``: each timing's noise on the log scale."""
    rng = np.random.default_rng(int(effect * 100) + num_rounds)
    detected = 0
    for _ in range(1000):
        times = np.exp(_noise(rng, sd, (2, num_rounds), heavy=False))
        r = Rounds()
        for a, b in times.T:
            r.add("new", {"seconds": float(a)})
            r.add("old", {"seconds": float(b * effect)})
        v = compare(r, "new", "old", "seconds", higher_is_better=False, claim="new is faster")
        detected += v.holds
        assert audit(v.text) == [], v.text
    assert detected / 1000 >= power


def test_the_t_distribution_matches_the_published_critical_values() -> None:
    for df, critical in [(1, 6.314), (2, 2.920), (3, 2.353), (4, 2.132), (7, 1.895), (10, 1.812), (30, 1.697)]:
        assert t_cdf(critical, df) == pytest.approx(0.95, abs=1e-4)
        assert t_cdf(-critical, df) == pytest.approx(0.05, abs=1e-4)
    assert t_cdf(0.0, 5) == 0.5 and t_cdf(math.inf, 3) == 1.0
    assert p_one_sided(6.4, 1) < ALPHA < p_one_sided(6.2, 1)
    with pytest.raises(ValueError, match="at least 1 degree of freedom"):
        t_cdf(1.0, 0)


def test_the_t_statistics() -> None:
    t, df = one_sample_t([0.1, 0.3])  # mean 0.2, sd 0.1414, se 0.1
    assert df == 1 and t == pytest.approx(2.0)
    assert one_sample_t([0.2, 0.2]) == (math.inf, 1)  # identical rounds: no noise to doubt them
    assert one_sample_t([0.2]) == (0.0, 1)  # one round: nothing to test, never "holds"
    t2, df2 = two_sample_t([0.0, 0.2], [1.0, 1.2])
    assert df2 == 2 and t2 == pytest.approx(1.0 / math.sqrt(0.02 * (1 / 2 + 1 / 2)))


def test_two_rounds_must_agree_closely_and_the_printed_p_is_audited() -> None:
    def rounds(new: list[float], old: list[float]) -> Rounds:
        r = Rounds()
        for a, b in zip(new, old):
            r.add("new", {"seconds": a})
            r.add("old", {"seconds": b})
        return r

    close = compare(rounds([1.0, 1.0], [1.5, 1.6]), "new", "old", "seconds", False, "new is faster")
    assert close.holds and "p=0.0" in close.text and audit(close.text) == []
    spread = compare(rounds([1.0, 1.0], [1.1, 1.9]), "new", "old", "seconds", False, "new is faster")
    # every round favoured the claim by far more than 2%, but two rounds this far apart are not 5% evidence
    assert spread.outcome == "too close to call" and "vary too much for the 5% test" in spread.text
    assert audit(spread.text) == []
    assert audit(spread.text.replace("[too close to call]", "[holds]", 1)) != []  # p above 5%: caught
    assert audit(close.text.replace("[holds]", "[too close to call]", 1)) != []  # p below 5%, rounds agree: caught


def test_simulated_claims_from_measured_inputs_are_audited_not_exempt() -> None:
    counted = "[holds] the useful share falls: 100% -> 54% (token counts: exact, the same in every round)"
    assert audit(counted) == []  # counted, not timed: nothing to doubt
    simulated = ("[holds] the best split beats colocation (exact: simulated in virtual time, the same on every run)")
    assert audit(simulated) == [f"verdict without its round figures: {simulated}"]
