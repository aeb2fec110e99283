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

Benchmarks are scripts, not tests (DESIGN.md section 6): compare side by side in one run, report ratios, name
the hardware. Notebooks 07 and 08 explain what is measured here.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, not installed
from bench_common import OtherLoad  # noqa: E402  (scripts/ is on sys.path)
from benchlib.engines_figures import save_figures  # noqa: E402
from benchlib.engines_parts import chunk_experiment, median_run, slot_row, time_breakdown  # noqa: E402
from benchlib.engines_report import report  # noqa: E402
from benchlib.engines_throughput import (  # noqa: E402
    FULL,
    HF_CB,
    LABKIT_ENGINES,
    SMOKE,
    Result,
    hf_model,
    kv_tokens_for,
    run_hf_continuous,
    run_hf_generate,
    run_labkit,
)

from labkit.core.device import resolve_device  # noqa: E402
from labkit.core.model.source import bundled_model_path  # noqa: E402
from labkit.core.text.tokenizer import load_tokenizer  # noqa: E402
from labkit.course.workloads import load_workload, materialise  # noqa: E402
from labkit.measure.hardware import device_name  # noqa: E402

DEFAULT_OUT = ROOT / "docs" / "benchmarks" / "engines.md"


def main() -> int:
    parser = argparse.ArgumentParser(description="engines side by side on a heterogeneous workload; chunked prefill")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CI); no report unless --out is given")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"Markdown report (default {DEFAULT_OUT.relative_to(ROOT)}; none with --smoke)")
    parser.add_argument("--device", default="cpu", help="cpu (default, as the goals are stated) or auto/cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--skip-transformers", action="store_true", help="labkit's engines only")
    parser.add_argument("--repeats", type=int, default=None,
                        help="rounds of part 1 (default 3, --smoke 1); the report shows medians and every "
                             "round's ratio")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = SMOKE if args.smoke else FULL
    device = str(resolve_device(args.device))
    command = " ".join([".venv/bin/python", "scripts/bench_engines.py", *sys.argv[1:]])
    started, load = time.perf_counter(), OtherLoad()
    time.sleep(1.0)
    load_before = load.fraction()
    load = OtherLoad()

    # Part 2 first: its short runs are the most sensitive to the machine slowing down over a long run.
    chunk_rows, decode_step, long_arrivals, example_runs = chunk_experiment(sizes, device)
    tokenizer = load_tokenizer(bundled_model_path())
    workload = materialise(load_workload(sizes.workload), tokenizer, seed=0)
    prefill_workload = materialise(load_workload(sizes.prefill_workload), tokenizer, seed=1)
    print(workload.summary())
    print(prefill_workload.summary())
    repeats = args.repeats if args.repeats is not None else (1 if args.smoke else 3)
    model = None if args.skip_transformers else hf_model(device)
    rounds: list[list[Result]] = []
    sweep: dict[int, list[tuple[Result, Result | None]]] = {n: [] for n in sizes.slots}
    prefill_rounds: list[tuple[Result, Result | None]] = []  # part 1d: chunked and padded generate, default options
    for _ in tqdm(range(repeats), desc="rounds of part 1"):  # whole rounds, so a slow spell hits every system
        results = [run_labkit(engine, workload, sizes, device) for engine in LABKIT_ENGINES]
        if model is not None:
            results.append(run_hf_generate(model, workload, sizes))
            results.append(run_hf_continuous(model, workload, sizes, kv_tokens_for(sizes.max_num_seqs)))
        rounds.append(results)
        for slots in sizes.slots:  # part 1b, in the same round
            if slots == sizes.max_num_seqs:  # already run above with these settings
                by_name = {r.name: r for r in results}
                sweep[slots].append((by_name["chunked"], by_name.get(HF_CB)))
                continue
            sized = replace(sizes, max_num_seqs=slots)
            sweep[slots].append((run_labkit("chunked", workload, sized, device),
                                 None if model is None else run_hf_continuous(model, workload, sized,
                                                                              kv_tokens_for(slots))))
        prefill_rounds.append((run_labkit("chunked", prefill_workload, sizes, device),  # part 1d, same round
                               None if model is None else run_hf_generate(model, prefill_workload, sizes)))
    # Each system's median round; each ratio also per round, to show the spread.
    results = [median_run(list(runs)) for runs in zip(*rounds)]
    round_ratios = {r.name: [next(x for x in rnd if x.name == "chunked").tokens_per_s / x.tokens_per_s
                             for rnd in rounds for x in rnd if x.name == r.name] for r in results}
    slot_rows = [slot_row(n, runs) for n, runs in sweep.items()]
    # Part 1c: one timed run at the fewest and the most slots (on the CPU, where calls are synchronous).
    breakdowns = ([time_breakdown(workload, sizes, n) for n in sorted({min(sizes.slots), max(sizes.slots)})]
                  if device == "cpu" else [])
    chunked = next(r for r in results if r.name == "chunked")
    print(f"\n{'system':<52} {'tok/s':>8} {'seconds':>8} {'chunked is':>10}")
    for r in results:
        print(f"{r.name:<52} {r.tokens_per_s:8.1f} {r.seconds:8.2f} {chunked.tokens_per_s / r.tokens_per_s:9.2f}x")
    print(f"\n{'slots':>5} {'chunked tok/s':>14} {'generate_batch tok/s':>21} {'ratio':>7}")
    for row in slot_rows:
        hf = "-" if row.hf is None else f"{row.hf.tokens_per_s:.1f}"
        print(f"{row.slots:>5} {row.chunked.tokens_per_s:14.1f} {hf:>21} "
              f"{'-' if row.ratio is None else f'{row.ratio:.2f}x':>7}")

    for b in breakdowns:
        print(f"chunked, {b.slots} slots: {b.total:.2f} s = linear layers {b.matmul:.2f} + attention "
              f"{b.attention:.2f} + other {b.other:.2f}; matmul-only ceiling {b.matmul_only_tokens_per_s:.0f} tok/s")

    base = chunk_rows[0]
    print(f"\n{'engine':<16} {'ITL p99 ms':>10} {'vs cont.':>9} {'tok/s':>8} {'vs cont.':>9} {'long TTFT ms':>12}")
    for r in chunk_rows:
        print(f"{r.name:<16} {r.itl_p99 * 1e3:10.1f} {r.itl_p99 / base.itl_p99:8.2f}x {r.throughput:8.1f} "
              f"{r.throughput / base.throughput:8.2f}x {r.ttft_long * 1e3:12.0f}")

    wall_s = time.perf_counter() - started
    other = load.fraction()
    dev = torch.device(device)
    hw = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": f"{device_name(dev)} ({device})",
        "torch threads / CPUs": f"{torch.get_num_threads()} / {os.cpu_count()}",
        "other processes' CPU load": ("unknown" if load_before is None else f"{load_before:.0%} of all CPUs at start")
        + "; " + ("unknown" if other is None else f"{other:.0%} during the run")
        + " (above ~10% the timings are unreliable)",
        "torch / transformers": f"{torch.__version__} / {__import__('transformers').__version__}",
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
    }
    if other is not None and other > 0.1:
        print(f"warning: other processes kept {other:.0%} of the CPUs busy; timings are skewed", file=sys.stderr)
    out = args.out if args.out is not None else (None if args.smoke else DEFAULT_OUT)
    text, goals = report(command, sizes, workload, results, chunk_rows, decode_step, long_arrivals, hw, wall_s,
                         figure_stem=None if out is None else out.stem, other_load=other, round_ratios=round_ratios,
                         slot_rows=slot_rows, breakdowns=breakdowns,
                         prefill=(prefill_workload, prefill_rounds))
    print("\n" + "\n".join(goals))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
        figures = save_figures(out, results, chunk_rows, example_runs, sizes, slot_rows)
        print(f"wrote {out} and {', '.join(str(f) for f in figures)}")
    print(f"{wall_s:.0f} s in all; other processes' CPU load during the run: "
          f"{'unknown' if other is None else f'{other:.0%}'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
