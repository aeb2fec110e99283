"""How well the simulator (``labkit.sim``) predicts real runs it was not fitted on.

Run from the repository root:

    .venv/bin/python scripts/bench_sim_calibration.py            # full sizes (a few minutes on a CPU)
    .venv/bin/python scripts/bench_sim_calibration.py --smoke    # small sizes, about a minute

In one run, on the bundled model, one torch thread per worker (one "device" each):

1. Calibrate: a ``chunked`` engine whose scheduler records each step's shape (``RecordingScheduler``) runs a
   calibration workload; ``StepCostModel.fit`` fits the step times.
2. Held-out workloads (other prompt lengths, rates and output lengths than the fit's), each run for real on
   ``chunked`` and simulated (labkit's own ``Scheduler`` in virtual time, priced by the fitted model); and one run
   of the two-process ``disaggregated`` engine against the simulator's 1P:1D cluster on the measured loopback link.
3. For each: measured and predicted TTFT p50 and TPOT p50, and the relative error (the issue's target: within 15%).

Benchmarks are scripts, not tests: one run, side by side, the hardware named. Notebook 12 explains the simulator.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

import torch

from labkit import LLM
from labkit.cache.paged import kv_block_bytes
from labkit.sim import ClusterSpec, RecordingScheduler, calibrate, measured_records, poisson_requests, simulate
from labkit.sim.calibrate import run_real

BLOCK_SIZE = 16
SIM_OPTIONS = dict(max_num_seqs=16, max_num_batched_tokens=128, block_size=BLOCK_SIZE)


def p50(records: list, metric: str) -> float:  # type: ignore[type-arg]
    return statistics.median(getattr(r, metric) for r in records)


def report(name: str, real: list, sim: list) -> list[float]:  # type: ignore[type-arg]
    errors = []
    cells = []
    for metric in ("ttft", "tpot"):
        a, b = p50(real, metric), p50(sim, metric)
        errors.append(abs(b / a - 1))
        cells.append(f"{metric.upper()} p50 {a * 1e3:8.1f} ms measured, {b * 1e3:8.1f} ms predicted "
                     f"({(b / a - 1) * 100:+5.0f}%)")
    print(f"{name:<34} " + " | ".join(cells))
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="small sizes")
    parser.add_argument("--model", default="labkit-tiny")
    args = parser.parse_args()
    torch.set_num_threads(1)
    scale = 1 if args.smoke else 3
    print(f"hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch "
          f"{torch.__version__}, one thread per worker; model {args.model}")
    with LLM(args.model, engine="chunked", scheduler_cls=RecordingScheduler, **SIM_OPTIONS) as llm:
        fit = poisson_requests(40.0, 12 * scale, [16, 64, 160, 320], 24, seed=1)
        cost, shapes, seconds = calibrate(llm, fit)
        rel = [abs(cost.step_time(s) / t - 1) for s, t in zip(shapes, seconds)]
        print(f"calibration: {len(shapes)} steps, fitted {cost.describe()}, median step error "
              f"{statistics.median(rel) * 100:.0f}%")
        spec = ClusterSpec(num_decode=1, num_blocks=llm.engine.num_blocks, **SIM_OPTIONS)
        held_out = {
            "chunked: short prompts, 6 req/s": poisson_requests(6.0, 8 * scale, [24, 48], 16, seed=7),
            "chunked: long prompts, 3 req/s": poisson_requests(3.0, 6 * scale, [200, 400], 16, seed=8),
            "chunked: mixed, burst": poisson_requests(float("inf"), 6 * scale, [32, 256], 24, seed=9),
        }
        errors = []
        for name, reqs in held_out.items():
            errors += report(name, measured_records(run_real(llm, reqs, seed=3)), simulate(reqs, cost, spec).records)
    with LLM(args.model, engine="disaggregated", prefill_num_threads=1, **SIM_OPTIONS) as llm:
        reqs = poisson_requests(4.0, 6 * scale, [64, 256], 16, seed=10)
        run_real(llm, reqs[:2], seed=5)  # warm-up
        bandwidth = 2 * (1 << 22) / min(llm.engine.measure_link(1 << 22) for _ in range(3))
        per_token = kv_block_bytes(llm.model_config, BLOCK_SIZE, llm.model.dtype) // BLOCK_SIZE
        spec = ClusterSpec(num_prefill=1, num_decode=1, kv_bytes_per_token=per_token, link_bandwidth=bandwidth,
                           num_blocks=llm.engine.num_blocks, **SIM_OPTIONS)
        errors += report("disaggregated 1P:1D, 4 req/s", measured_records(run_real(llm, reqs, seed=3)),
                         simulate(reqs, cost, spec).records)
    print(f"largest error: {max(errors) * 100:.0f}% (target: 15%); loopback link {bandwidth / 1e9:.2f} GB/s measured")


if __name__ == "__main__":
    main()
