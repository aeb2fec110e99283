"""Benchmark the engines side by side: throughput on a heterogeneous workload, and what chunking buys.

Run from the repository root:

    .venv/bin/python scripts/bench_engines.py               # full run (64 requests), writes docs/benchmarks/engines.md
    .venv/bin/python scripts/bench_engines.py --smoke       # small sizes, well under a minute; no report
    .venv/bin/python scripts/bench_engines.py --threads 1   # on a shared machine: fewer threads, steadier timings

In one run, on the bundled model (CPU float32 unless --device says otherwise):

1. Throughput (output tokens/s over the wall time of the whole workload; median of ``--repeats`` rounds,
   3 by default, every round's ratio reported too) of labkit's engines ``kvcache``,
   ``paged``, ``continuous`` and ``chunked``, and of transformers' own batched generation on the same
   checkpoint: ``model.generate`` on FCFS batches of ``max_num_seqs`` prompts, left-padded, each batch run
   to its longest output; and transformers' continuous batching (``generate_batch``'s engine, the
   ``ContinuousBatchingManager``, given each request's own ``max_new_tokens``). Workload:
   ``data/workloads/heterogeneous_64.jsonl`` (64 requests, prompts 16-873 tokens, outputs 16-256), greedy,
   every request producing exactly its output length. Ratios are against ``chunked``.
1b. Batch slots: ``chunked`` and transformers' continuous batching again with 8, 16, 32 and 64 slots
   (``max_num_seqs`` = ``max_requests_per_batch``), in the same rounds; the ratio at equal slots and each
   system at its own best number of slots.
1c. Where ``chunked``'s time goes (CPU): one run at the fewest and the most slots with the linear layers
   and the attention backend timed, the rest being everything else; and the throughput ceiling if only the
   linear layers took time.
1d. A prefill-heavier mix (``data/workloads/prefill_heavy_48.jsonl``: 48 requests, prompts 16-768 tokens, outputs
   16-192): ``chunked`` against transformers' padded ``generate``, both with 16 slots and default options, in the
   same rounds as part 1.
2. Chunked prefill against whole-prompt prefill (notebook 08's experiment, larger): short requests decode
   while long prompts arrive mid-run (``LLM.generate(..., arrival_times=...)``). p99 ITL (every gap of
   every request) and throughput of ``continuous`` and of ``chunked`` at several token budgets, medians of
   a few repetitions, as ratios against ``continuous``.

Goals (the issues'): ``chunked`` >= 2x transformers' padded ``generate`` (on both workloads) and >= 3x its continuous
batching in output tokens/s, at 16 equal slots and with each at its own best number of slots; p99 ITL with chunking
<= 0.5x without it, at <= 10% throughput cost.

Benchmarks are scripts, not timed tests: compare side by side in one run, report ratios, name the hardware.
Notebooks 07 and 08 explain what is measured here; the parts live in ``labkit.measure.benchmarks.engines`` and
``labkit.measure.benchmarks.engines_report``.
"""

from __future__ import annotations

import sys
import time

from labkit.core.model.source import bundled_model_path
from labkit.core.text.tokenizer import load_tokenizer
from labkit.measure.benchmarks.cli import REPO_ROOT, bench_parser, start_bench
from labkit.measure.benchmarks.engines import (
    FULL,
    SMOKE,
    chunk_experiment,
    hf_model,
    measure_throughput,
    time_breakdown,
)
from labkit.measure.benchmarks.engines_report import hardware_table, print_summary, report, save_figures
from labkit.measure.load import OtherLoad
from labkit.measure.workloads import load_workload, materialise

DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "engines.md"


def main() -> int:
    parser = bench_parser("engines side by side on a heterogeneous workload; chunked prefill", DEFAULT_OUT,
                          device_help="cpu (default, as the goals are stated) or auto/cuda", dtype=False)
    parser.add_argument("--skip-transformers", action="store_true", help="labkit's engines only")
    parser.add_argument("--repeats", type=int, default=None,
                        help="rounds of part 1 (default 3, --smoke 1); the report shows medians and every "
                             "round's ratio")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else FULL
    bench = start_bench(args, "bench_engines.py", DEFAULT_OUT)
    device, load = str(bench.device), OtherLoad()

    # Part 2 first: its short runs are the most sensitive to the machine slowing down over a long run.
    chunk_rows, decode_step, long_arrivals, example_runs = chunk_experiment(sizes, device)
    tokenizer = load_tokenizer(bundled_model_path())
    workload = materialise(load_workload(sizes.workload), tokenizer, seed=0)
    prefill_workload = materialise(load_workload(sizes.prefill_workload), tokenizer, seed=1)
    print(workload.summary())
    print(prefill_workload.summary())
    repeats = args.repeats if args.repeats is not None else (1 if args.smoke else 3)
    model = None if args.skip_transformers else hf_model(device)
    part1 = measure_throughput(workload, prefill_workload, sizes, device, model, repeats)
    # Part 1c: one timed run at the fewest and the most slots (on the CPU, where calls are synchronous).
    breakdowns = ([time_breakdown(workload, sizes, n) for n in sorted({min(sizes.slots), max(sizes.slots)})]
                  if device == "cpu" else [])
    print_summary(part1.results, part1.slot_rows, breakdowns, chunk_rows)

    wall_s = time.perf_counter() - bench.t0
    other = load.fraction()
    if other > 0.1:
        print(f"warning: other processes kept {other:.0%} of the CPUs busy; timings are skewed", file=sys.stderr)
    out = bench.out
    text, goals = report(bench.command, sizes, workload, part1.results, chunk_rows, decode_step, long_arrivals,
                         hardware_table(bench.hw, other), wall_s, figure_stem=None if out is None else out.stem,
                         other_load=other, round_ratios=part1.round_ratios, slot_rows=part1.slot_rows,
                         breakdowns=breakdowns, prefill=(prefill_workload, part1.prefill_rounds))
    print("\n" + "\n".join(goals))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
        figures = save_figures(out, part1.results, chunk_rows, example_runs, sizes, part1.slot_rows)
        print(f"wrote {out} and {', '.join(str(f) for f in figures)}")
    print(f"{wall_s:.0f} s in all; other processes' CPU load during the run: {other:.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
