"""Speculative decoding against plain decoding on the bundled model: acceptance rate, speed-up, p99 ITL.

Plain decoding, prompt lookup (ngram) and the self-speculative draft (the target's first layer) run side by side in
interleaved rounds (labkit.measure.rounds.interleave), on a workload whose answer is quoted in the prompt and on
fresh story openings, at batch 1 and at a larger batch. Speed-ups are taken round by round (each contender's tokens/s
over plain decoding's in the same round) and reported as the median with the rounds' range.

    .venv/bin/python scripts/bench_spec_decode.py            # writes docs/benchmarks/spec_decode.md
    .venv/bin/python scripts/bench_spec_decode.py --smoke    # tiny sizes, no report

Benchmarks are scripts, not timed tests: compare side by side in one run, report ratios, name the hardware. The
comparison lives in ``labkit.measure.benchmarks.spec_decode``.
"""

from __future__ import annotations

import time

from labkit.measure.benchmarks.cli import REPO_ROOT, bench_parser, start_bench
from labkit.measure.benchmarks.report import finish_report, md_table, report_header
from labkit.measure.benchmarks.spec_decode import FULL, HEADERS, SMOKE, measure_rows
from labkit.measure.load import OtherLoad

DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "spec_decode.md"


def main() -> None:
    parser = bench_parser("speculative decoding vs plain decoding on the bundled model", DEFAULT_OUT)
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; 2 with --smoke)")
    args = parser.parse_args()
    bench = start_bench(args, "bench_spec_decode.py", DEFAULT_OUT)
    assert bench.dtype is not None  # bench_parser gave it --dtype
    other_load = OtherLoad()
    rounds_n = args.rounds or (2 if args.smoke else 3)
    sizes = SMOKE if args.smoke else FULL
    rows = measure_rows(bench.device, bench.dtype, sizes, rounds_n)
    load = other_load.fraction()
    lines = report_header("Benchmark: speculative decoding vs plain decoding", bench.command, bench.hw,
                          time.perf_counter() - bench.t0, load)
    lines += [f"Bundled model, engine `chunked`, greedy, {sizes.max_tokens} output tokens per request, median of "
              f"{rounds_n} interleaved rounds (speed-up: round by round over plain decoding; range in brackets). "
              "Greedy output is identical in every row (tests/core/spec_decode).", "",
              md_table(HEADERS, rows)]
    finish_report("\n".join(lines) + "\n", bench.out, load)


if __name__ == "__main__":
    main()
