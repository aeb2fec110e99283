"""The one statistics type of the workbook: mean, median, std, p90 and p99 of a list of latencies.

Every latency statistic labkit reports goes through ``Percentiles.of``: the run summaries of notebooks 07-08
(``labkit.measure.summary``), the load generator of notebook 09 (``labkit.measure.loadgen.metrics``) and the scripts.
The rules, once:

* **seconds inside.** Values go in and come out in seconds, like every timestamp in labkit. Milliseconds exist only
  where numbers are shown or written (``Percentiles.ms()``, the benchmark's JSON file and report), so no number
  changes unit on its way through the code.
* **numpy's definitions.** Percentiles by ``numpy.percentile`` with linear interpolation (vLLM's benchmark uses the
  same); ``std`` is the population standard deviation (``numpy.std``, ddof 0), as vLLM reports it.
* **empty is zero.** A list with no values gives 0.0 in every statistic and ``count`` 0, as ``vllm bench serve``
  reports it (e.g. TPOT when every request produced a single token). ``count`` is what tells "no values" from
  "all zero". Zero rather than NaN keeps the JSON file valid and vLLM-compatible, and keeps equal results equal
  (NaN != NaN would make two identical summaries compare unequal).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np


@dataclass(frozen=True)
class Percentiles:
    """Mean, median, std, p90 and p99 of some latencies, in seconds; all 0 (``count`` 0) when there are none.

    Introduced in notebook 07 (``07_continuous_batching``) for run summaries; notebook 09
    (``09_serving_and_metrics``) reads the load generator's numbers from the same type.
    """

    mean: float
    median: float
    std: float
    p90: float
    p99: float
    count: int

    STATS: ClassVar[tuple[str, ...]] = ("mean", "median", "std", "p90", "p99")  # the order reports list them in

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        """The statistics of ``values`` (seconds); every one 0.0 with ``count`` 0 for an empty list."""
        if len(values) == 0:
            return cls(mean=0.0, median=0.0, std=0.0, p90=0.0, p99=0.0, count=0)
        a = np.asarray(values, dtype=float)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(mean=float(a.mean()), median=float(p50), std=float(a.std()), p90=float(p90), p99=float(p99),
                   count=len(a))

    def ms(self) -> dict[str, float]:
        """The statistics in milliseconds, keyed ``mean``, ``median``, ``std``, ``p90``, ``p99`` (for display)."""
        return {name: getattr(self, name) * 1e3 for name in self.STATS}
