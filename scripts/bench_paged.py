"""Benchmark paged KV memory and prefix caching (notebook 06), side by side in one run.

Run from the repository root:

    .venv/bin/python scripts/bench_paged.py              # full run, ~3-5 min on 2 CPU cores
    .venv/bin/python scripts/bench_paged.py --smoke      # small sizes, about a minute
    .venv/bin/python scripts/bench_paged.py --out docs/benchmarks/paged.md

A full run writes docs/benchmarks/paged.md and two figures beside it (a smoke run writes only when given
--out). In one run:

1. KV memory waste on the heterogeneous workload (``data/workloads/heterogeneous_64.jsonl``), contiguous
   reservation against paging: the share of allocated KV memory that holds no token, split into
   reserved-but-unused and internal fragmentation (``labkit.measure.kv_memory``, over every step of every request's
   life). Goal: paged <= 4%.
2. Concurrent sequences at equal KV budget: by accounting (every sequence counted at its longest, so no
   preemption is ever needed), and on the real ``paged`` engine given a pool the size of a few
   ``max_model_len`` reservations, which admits by prompt size and grows on demand.
3. TTFT with and without prefix caching, engine ``paged``: requests sharing a 512-token prefix plus a
   16-token question of their own. The first request runs alone and computes the prefix (with caching,
   its blocks stay cached); then 16 requests arrive together. The mean TTFT of those 16 is the figure
   (median over rounds, fresh questions each round). Goal: >= 3x lower with caching.
4. The cost of caching at a 0% hit rate: a workload of unrelated prompts (fresh every round, so nothing
   is found), caching on and off alternating; throughput ratio (goal: <= 1% lower), and the time the
   block manager spends hashing and looking up blocks, which is steadier than a throughput difference.

Benchmarks are scripts, not timed tests: compare side by side in one run, report ratios, name the hardware. The
parts live in ``labkit.measure.benchmarks.paged`` and ``labkit.measure.benchmarks.paged_report``.
"""

from __future__ import annotations

import sys
import time

import matplotlib

matplotlib.use("Agg")  # a script: draw to files

from labkit.measure.benchmarks.cli import REPO_ROOT, bench_parser, start_bench  # noqa: E402
from labkit.measure.benchmarks.paged import (  # noqa: E402
    FULL,
    MODEL,
    SMOKE,
    WASTE_WORKLOAD,
    concurrency_table,
    kv_bytes_per_token_of,
    measure_cost,
    measure_engine_run,
    measure_prefix_caching,
    waste_table,
)
from labkit.measure.benchmarks.paged_report import draw_figures, report  # noqa: E402
from labkit.measure.benchmarks.report import finish_report  # noqa: E402
from labkit.measure.load import OtherLoad  # noqa: E402
from labkit.measure.workloads import load_workload  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "paged.md"


def main() -> int:
    parser = bench_parser("paged KV memory waste, concurrency and prefix caching, side by side", DEFAULT_OUT)
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else FULL
    bench = start_bench(args, "bench_paged.py", DEFAULT_OUT)
    out, device, dtype = bench.out, bench.device, bench.dtype
    assert dtype is not None  # bench_parser gave it --dtype
    other_load = OtherLoad()

    wl = load_workload(WASTE_WORKLOAD)
    layouts, life, peak = waste_table(wl)
    budgets, fits = concurrency_table(wl, layouts)
    for name, u in life.items():
        print(f"  {name:<48} waste {u.waste_fraction:6.1%}")

    run = measure_engine_run(device, dtype, sizes)
    print(f"  engine at {run.budget_tokens} slots: {run.max_running} sequences at once "
          f"(contiguous: {run.budget_tokens // run.max_model_len}), {run.num_preemptions} preemptions")
    prefix = measure_prefix_caching(device, dtype, sizes)
    print(f"  TTFT off {prefix[False].ttft_mean * 1e3:.1f} ms, on {prefix[True].ttft_mean * 1e3:.1f} ms")
    cost = measure_cost(device, dtype, sizes)
    print(f"  0% hit rate: throughput on/off {cost.ratio:.3f}")

    bytes_per_token = kv_bytes_per_token_of(MODEL, dtype)
    out_dir = (out or DEFAULT_OUT).parent
    figures = draw_figures(out_dir, wl.name, life, fits, budgets, prefix, sizes) if out is not None else []
    text = report(bench.command, bench.hw, sizes, wl, life, peak, budgets, fits, run, prefix, cost, bytes_per_token,
                  figures, out_dir, time.perf_counter() - bench.t0, other_load.fraction())
    finish_report(text, out, other_load.fraction())
    if figures:
        print(f"wrote {', '.join(str(p) for p in figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
