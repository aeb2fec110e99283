"""Benchmark tensor parallelism on this machine: all-reduce latency and bandwidth by size, and a decode step split
into compute and communication at tensor_parallel_size 1 and 2.

    .venv/bin/python scripts/bench_tensor_parallel.py            # writes docs/benchmarks/tensor_parallel.md
    .venv/bin/python scripts/bench_tensor_parallel.py --smoke    # tiny sizes, no report unless --out

Writes docs/benchmarks/tensor_parallel.md and .json. The parts live in
``labkit.measure.benchmarks.tensor_parallel_report``.
"""

from __future__ import annotations

import sys

from labkit.measure.benchmarks.cli import REPO_ROOT, run_cpu_bench
from labkit.measure.benchmarks.tensor_parallel_report import FULL, SMOKE, report, run

DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "tensor_parallel.md"

if __name__ == "__main__":
    sys.exit(run_cpu_bench(__doc__, "bench_tensor_parallel.py", DEFAULT_OUT, run, report, FULL, SMOKE))
