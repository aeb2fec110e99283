"""Benchmark tensor parallelism on this machine: all-reduce latency and bandwidth by size, and a decode step split
into compute and communication at tensor_parallel_size 1 and 2.

    .venv/bin/python scripts/bench_tensor_parallel.py            # writes docs/benchmarks/tensor_parallel.md
    .venv/bin/python scripts/bench_tensor_parallel.py --smoke    # tiny sizes, no report unless --out

Writes docs/benchmarks/tensor_parallel.md and .json. The parts live in
``labkit.measure.benchmarks.tensor_parallel_report``.
"""

from __future__ import annotations

import sys
import time

import torch

from labkit.measure.benchmarks.cli import REPO_ROOT, bench_parser, start_bench
from labkit.measure.benchmarks.report import finish_report
from labkit.measure.benchmarks.tensor_parallel_report import FULL, SMOKE, report, run
from labkit.measure.load import OtherLoad

DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "tensor_parallel.md"


def main() -> int:
    args = bench_parser(__doc__.splitlines()[0], DEFAULT_OUT, dtype=False).parse_args()
    start = start_bench(args, "bench_tensor_parallel.py", DEFAULT_OUT)
    other_load = OtherLoad()
    res = run(SMOKE if args.smoke else FULL, torch.get_num_threads())
    load = other_load.fraction()
    finish_report(report(res, start.command, start.hw, time.perf_counter() - start.t0, load), start.out, load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
