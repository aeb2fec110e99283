"""The benchmarks behind ``scripts/bench_*.py``: their sizes, measurements, reports and figures, one module each.

Benchmarks are scripts, not timed tests: they compare systems side by side in one run (interleaved rounds,
``labkit.measure.rounds.interleave``), report ratios rather than absolute times, and name the hardware and how busy
other programs kept it (``report``). The scripts are thin command lines over these modules: ``cli`` parses the
options every benchmark shares and describes the machine, each benchmark module measures, and its ``*_report``
module writes the Markdown under ``docs/benchmarks/``. This package imports ``labkit.core``, ``labkit.serving`` and
the rest of ``labkit.measure``, never ``labkit.course`` (the layer contract in pyproject.toml).
"""
