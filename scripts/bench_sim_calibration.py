"""How well the simulator (``labkit.measure.sim``) predicts real runs it was not fitted on.

Run from the repository root:

    .venv/bin/python scripts/bench_sim_calibration.py            # full sizes (a few minutes on a CPU); writes
                                                                 # docs/benchmarks/sim_calibration.md
    .venv/bin/python scripts/bench_sim_calibration.py --smoke    # small sizes, about a minute; no report

On the bundled model, one torch thread per worker (one "device" each), in rounds (3; 2 with ``--smoke``), each:

1. Calibrate: a ``chunked`` engine whose scheduler records each step's shape (``RecordingScheduler``) runs a
   calibration workload; ``StepCostModel.fit`` fits the step times.
2. Held-out workloads (other prompt lengths, rates and output lengths than the fit's), each run for real on
   ``chunked`` and simulated (labkit's own ``Scheduler`` in virtual time, priced by the round's fit); and a run
   of the two-process ``disaggregated`` engine against the simulator's 1P:1D cluster on the measured loopback link
   (latency from a tiny echo, bandwidth from a 4 MiB one).
3. For each: measured and predicted TTFT p50 and TPOT p50 and their relative error; the report gives each round's
   error and their median (the issue's target: within 15%).

Benchmarks are scripts, not timed tests: compare side by side in one run, report ratios, name the hardware. Notebook
12 explains the simulator; the rounds live in ``labkit.measure.benchmarks.sim_calibration``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from labkit.measure.benchmarks.cli import REPO_ROOT, command_line, shown
from labkit.measure.benchmarks.report import finish_report, hardware, report_header
from labkit.measure.benchmarks.sim_calibration import measure_calibration, report_intro
from labkit.measure.load import OtherLoad

DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "sim_calibration.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="small sizes, 2 rounds")
    parser.add_argument("--model", default="labkit-tiny")
    parser.add_argument("--rounds", type=int, default=None, help="calibrate-then-predict rounds (default 3)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"Markdown report (default {shown(DEFAULT_OUT)}; none with --smoke)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    t0, hw, other_load = time.perf_counter(), hardware(torch.device("cpu")), OtherLoad()
    scale, num_rounds = (1, args.rounds or 2) if args.smoke else (3, args.rounds or 3)
    printed: list[str] = []  # the report's body

    def say(line: str) -> None:
        print(line, flush=True)
        printed.append(line)

    say(f"model {args.model}, one torch thread per worker (one 'device' each), float32; {num_rounds} rounds, each "
        "fitting the cost model anew and then predicting the held-out workloads")
    for line in measure_calibration(args.model, scale, num_rounds, say).lines():
        say(line)
    load = other_load.fraction()
    lines = report_header("Benchmark: the simulator against real runs it was not fitted on",
                          command_line("bench_sim_calibration.py"), hw, time.perf_counter() - t0, load)
    lines += [*report_intro(), "```", *printed, "```"]
    out = args.out if args.out is not None else (None if args.smoke else DEFAULT_OUT)
    finish_report("\n".join(lines) + "\n", out, load)


if __name__ == "__main__":
    main()
