"""Measurements a learner can trust on a busy laptop: one discipline for every comparison a notebook concludes from.

* ``load``: what other programs use of this machine right now, and what to do about it;
* ``rounds``: the compared systems run interleaved and repeated, warm-up excluded, medians with the rounds' spread;
* ``verdict``: the direction the prose states ("continuous is faster", "the throughput falls"), checked against the
  measurement and printed next to it, with the likely reason when they disagree. Its false-alarm rate is stated:
  "holds" needs every round beyond a 2% tie band *and* a one-sided t-test on the rounds' log ratios at 5%
  (``significance``), so on a null effect a verdict says "holds" (or "does NOT hold") at most 5% of the time.

Introduced in notebook 03 (``03_kv_cache``); every notebook that compares systems uses it.
"""

from labkit.measure.load import LoadReport, check_machine, measure_load
from labkit.measure.rounds import Rounds, default_rounds, interleave, plot_rounds
from labkit.measure.verdict import Verdict, audit, compare, reaches, signed_change, trend

__all__ = ["LoadReport", "Rounds", "Verdict", "audit", "check_machine", "compare", "default_rounds", "interleave",
           "measure_load", "plot_rounds", "reaches", "signed_change", "trend"]
