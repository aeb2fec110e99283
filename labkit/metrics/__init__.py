"""Every number the workbook reports about requests, in one package (seconds inside; milliseconds only where shown).

- ``request``: one request's timestamps and its TTFT / ITL / TPOT / E2E (notebook 01); the one definition of each,
  which every module below uses.
- ``stats``: ``Percentiles``, the one statistics type (mean, median, std, p90, p99; 0 with ``count`` 0 when empty).
- ``summary``: a run's summary and Gantt rows from ``LLM.generate`` outputs (notebooks 07-08).
- ``benchmark``: the load generator's records, goodput and report (notebook 09, ``labkit.bench``).
- ``prometheus``: the server's ``/metrics`` exporter (notebook 09).

``summary`` is not imported here: it needs ``labkit.llm``, which needs ``request``, and would import in a circle.
"""

from labkit.metrics.request import RequestMetrics, compute_latencies, inter_token_latencies, time_per_output_token
from labkit.metrics.stats import Percentiles

__all__ = ["Percentiles", "RequestMetrics", "compute_latencies", "inter_token_latencies", "time_per_output_token"]
