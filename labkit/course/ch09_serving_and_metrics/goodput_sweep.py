"""Notebook 09's rate sweep repeated in rounds: SLOs from several baseline runs, the plot, and its verdict.

One run per rate on a busy laptop is a coin toss: a neighbour waking up during one run sinks its goodput, and the
sweep's shape ("goodput equals throughput below the knee and falls past it") flips between runs. The sweep is run
in rounds (every rate once per round, the order rotated), the SLOs come from the median of the lowest rate's rounds,
the plot shows the rounds' range, and ``goodput_verdict`` says whether the shape held in every round, and if not,
what broke it. Introduced in notebook 09 (``09_serving_and_metrics``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes

from labkit.measure import LoadReport, Verdict
from labkit.measure.loadgen import BenchResult
from labkit.measure.loadgen.metrics import RequestRecord
from labkit.measure.verdict import MARK, evidence, outcome_of

SweepRuns = Mapping[float, Sequence[BenchResult]]  # offered rate (req/s) -> one result per round
GoodputOf = Callable[[Sequence[RequestRecord], Mapping[str, float], float], float]  # (records, slos_ms, duration)
BELOW_KNEE = 0.7  # offered rates up to this share of the capacity count as "below the knee"
MET_SHARE = 0.9  # below the knee, at least this share of the requests must meet the SLOs ("goodput = throughput")


def baseline_slos(baseline: Sequence[BenchResult], ttft_factor: float = 4.0, tpot_factor: float = 2.0
                  ) -> dict[str, float]:
    """SLOs in ms from the rounds of the lowest rate: a multiple of the median over rounds of each round's median
    TTFT and TPOT, so that one noisy run does not set the targets."""
    if not baseline:
        raise ValueError("baseline_slos needs at least one run of the lowest rate")
    ttft = statistics.median(r.metrics.ttft.median for r in baseline) * 1e3
    tpot = statistics.median(r.metrics.tpot.median for r in baseline) * 1e3
    return {"ttft": round(ttft_factor * ttft, 1), "tpot": round(tpot_factor * tpot, 1)}


def _goodput(result: BenchResult, slos: Mapping[str, float], goodput_of: GoodputOf | None) -> float:
    if goodput_of is not None:
        return float(goodput_of(result.records, slos, result.duration))
    good = result.with_slos(slos).request_goodput
    return float(good if good is not None else result.metrics.request_throughput)


def goodput_verdict(factors: Sequence[float], runs: SweepRuns, slos: Mapping[str, float],
                    load: LoadReport | None = None, goodput_of: GoodputOf | None = None,
                    below_knee: float = BELOW_KNEE, met_share: float = MET_SHARE) -> Verdict:
    """Check "goodput equals throughput below the knee and falls past it" in every round.

    ``factors[i]`` is the offered rate ``sorted(runs)[i]`` as a share of the capacity. Below the knee (factors up to
    ``below_knee``) at least ``met_share`` of the completed requests must meet the SLOs in every round; past it, the
    goodput at the highest rate must be below the highest median goodput of the sweep in every round.
    """
    rates = sorted(runs)
    if len(rates) != len(factors) or len(rates) < 2:
        raise ValueError(f"goodput_verdict needs one factor per rate and at least two rates, got {len(factors)} "
                         f"factors for {len(rates)} rates")
    claim = "goodput equals throughput below the knee and falls past it"
    shares, reasons = [], []
    for f, rate in zip(factors, rates):
        if f > below_knee:
            continue
        for k, res in enumerate(runs[rate]):
            done = max(1, res.metrics.completed)
            share = _goodput(res, slos, goodput_of) * res.duration / done
            shares.append(share)
            if share < met_share:
                m = res.metrics
                reasons.append(f"at {rate:.2f} req/s (round {k + 1}) only {share:.0%} of the requests met the SLOs "
                               f"(TTFT p99 {m.ttft.p99 * 1e3:.0f} ms, TPOT p99 {m.tpot.p99 * 1e3:.0f} ms)")
    good = {rate: [_goodput(r, slos, goodput_of) for r in runs[rate]] for rate in rates}
    medians = {rate: statistics.median(g) for rate, g in good.items()}
    peak = max(rates[:-1], key=lambda r: medians[r])
    last = good[rates[-1]]
    # Two parts, each judged round by round as labkit.measure judges any claim (and printed so audit can check it):
    # the share of requests meeting the SLOs against the bar, and the best rate's goodput against the highest rate's.
    knee_ratios = [x / met_share for x in shares] or [float("inf")]
    fall_ratios = [min(good[peak]) / x if x > 0 else float("inf") for x in last]
    knee, fall = outcome_of(knee_ratios), outcome_of(fall_ratios)
    line_knee = (f"{MARK[knee]} below the knee (up to {below_knee:.0%} of capacity) at least {met_share:.0%} of the "
                 f"requests meet the SLOs: {min(shares, default=1.0):.0%}-{max(shares, default=1.0):.0%} did "
                 f"(rounds {min(knee_ratios):.2f}x-{max(knee_ratios):.2f}x of the bar{evidence(knee_ratios)})")
    line_fall = (f"{MARK[fall]} goodput falls past the knee: at {rates[-1]:.2f} req/s "
                 f"{', '.join(f'{x:.2f}' for x in last)} per round, against {', '.join(f'{x:.2f}' for x in good[peak])}"
                 f" at {peak:.2f} req/s (the sweep's best median; rounds {min(fall_ratios):.2f}x-"
                 f"{max(fall_ratios):.2f}x in the claim's favour{evidence(fall_ratios)})")
    outcome = ("holds" if knee == fall == "holds" else
               "contradicted" if "contradicted" in (knee, fall) else "too close to call")
    why = list(reasons)
    if fall != "holds":
        why.append("past the knee the queue grows only while the overload lasts: with few requests per run it stays "
                   "short and most of them still meet the SLOs (more requests per run make the fall clear)")
    if reasons:
        why.append("below the knee a request misses its SLO only when something delays it: on a shared machine, "
                   "another program taking the CPU for a moment (a noisy neighbour) delays every request in flight")
    if load is not None and load.busy:
        why.append(f"the sweep ran under load ({load.summary()}): close other programs and re-run.")
    text = f"{MARK[outcome]} {claim} (both parts below):\n   {line_knee}\n   {line_fall}"
    if outcome != "holds":
        text += "".join(f"\n   Likely reason: {w}" if i == 0 else f"\n   {w}" for i, w in enumerate(why))
    ratio = medians[peak] / medians[rates[-1]] if medians[rates[-1]] > 0 else float("inf")
    return Verdict(claim, outcome, ratio, (min(fall_ratios), max(fall_ratios)), text)


def _band(ax: Axes, xs: Sequence[float], per_x: Sequence[Sequence[float]], style: str, label: str,
          color: str | None = None) -> None:
    """Median line with the rounds' range as error bars."""
    med = np.array([statistics.median(v) for v in per_x])
    low = med - np.array([min(v) for v in per_x])
    high = np.array([max(v) for v in per_x]) - med
    ax.errorbar(xs, med, yerr=[low, high], fmt=style, capsize=3, label=label, color=color)


def plot_sweep(runs: SweepRuns, slos: Mapping[str, float], capacity: float, goodput_of: GoodputOf | None = None,
               title: str = "") -> None:
    """TTFT, TPOT and E2EL percentiles, throughput and goodput against the offered rate: medians of the rounds with
    their range; every SLO that is set drawn on its panel; the capacity line labelled."""
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.8), layout="constrained")
    xs = sorted(runs)
    for ax, key, name in zip(axes, ("ttft", "tpot", "e2el"), ("TTFT", "TPOT", "E2EL")):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            _band(ax, xs, [[getattr(r.metrics, key).ms()[stat] for r in runs[x]] for x in xs], style, stat)
        if key in slos:
            ax.axhline(slos[key], color="tab:red", ls=":", label=f"SLO {slos[key]:.0f} ms")
        ax.set_title(f"{name} (ms)")
        ax.set_ylim(bottom=0)
    ax = axes[3]
    ax.plot(xs, xs, color="tab:gray", ls=":", label="offered")
    _band(ax, xs, [[r.metrics.request_throughput for r in runs[x]] for x in xs], "o-", "throughput")
    _band(ax, xs, [[_goodput(r, slos, goodput_of) for r in runs[x]] for x in xs], "s-", "goodput", "tab:green")
    ax.set_title("requests / s")
    ax.set_ylim(bottom=0)
    for a in axes:
        a.set_xlabel("offered request rate (req/s)")
        a.grid(True, alpha=0.3)
        a.axvline(capacity, color="black", lw=0.8, alpha=0.5, label=f"capacity {capacity:.2f} req/s")
        a.legend(fontsize=7)
    rounds = len(runs[xs[0]])
    fig.suptitle(title or f"median of {rounds} rounds per rate (points), their range (bars)", fontsize=9)
    plt.show()
