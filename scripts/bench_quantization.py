"""Benchmark weight-only quantization (labkit float32, int8, int4) against the read roof and CTranslate2.

    .venv/bin/python scripts/bench_quantization.py              # full: smollm2-135m (random weights), ~5 min
    .venv/bin/python scripts/bench_quantization.py --smoke      # the bundled model, under a minute

Writes docs/benchmarks/quantization.md and .json (a smoke run only with --out). The parts live in
``labkit.measure.benchmarks.quantization_report``. CTranslate2 is a benchmark extra (``pip install 'labkit[bench]'``).
"""

from __future__ import annotations

import sys
import time

import torch

from labkit.measure.benchmarks.cli import REPO_ROOT, bench_parser, start_bench
from labkit.measure.benchmarks.quantization_report import FULL, SMOKE, report, run
from labkit.measure.benchmarks.report import finish_report
from labkit.measure.load import OtherLoad

DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "quantization.md"


def main() -> int:
    args = bench_parser(__doc__.splitlines()[0], DEFAULT_OUT, dtype=False).parse_args()
    start = start_bench(args, "bench_quantization.py", DEFAULT_OUT)
    other_load = OtherLoad()
    res = run(SMOKE if args.smoke else FULL, torch.get_num_threads())
    load = other_load.fraction()
    finish_report(report(res, start.command, start.hw, time.perf_counter() - start.t0, load), start.out, load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
