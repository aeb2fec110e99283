"""Benchmark weight-only quantization (labkit float32, int8, int4) against the read roof and CTranslate2.

    .venv/bin/python scripts/bench_quantization.py              # full: smollm2-135m (random weights), ~5 min
    .venv/bin/python scripts/bench_quantization.py --smoke      # the bundled model, under a minute

Writes docs/benchmarks/quantization.md and .json (a smoke run only with --out). The parts live in
``labkit.measure.benchmarks.quantization_report``. CTranslate2 is a benchmark extra (``pip install 'labkit[bench]'``).
"""

from __future__ import annotations

import sys

from labkit.measure.benchmarks.cli import REPO_ROOT, run_cpu_bench
from labkit.measure.benchmarks.quantization_report import FULL, SMOKE, report, run

DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "quantization.md"

if __name__ == "__main__":
    sys.exit(run_cpu_bench(__doc__, "bench_quantization.py", DEFAULT_OUT, run, report, FULL, SMOKE))
