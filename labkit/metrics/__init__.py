"""Every number the workbook reports about requests, in one package (seconds inside; milliseconds only where shown).

- ``request``: one request's timestamps and its TTFT / ITL / TPOT / E2E (notebook 01).
- ``stats``: ``Percentiles``, the one statistics type (mean, median, p90, p99, ...) used everywhere below.
- ``summary``: a run's summary and Gantt rows from ``LLM.generate`` outputs (notebooks 05, 07-08).
- ``benchmark``: the load generator's records, goodput and report (notebook 09, ``labkit.bench``).
- ``prometheus``: the server's ``/metrics`` exporter (notebook 09).
"""

from labkit.metrics.request import RequestMetrics, compute_latencies

__all__ = ["RequestMetrics", "compute_latencies"]
