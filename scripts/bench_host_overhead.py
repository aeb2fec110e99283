"""Benchmark host overhead: how much of each engine step the device spends waiting for Python.

Run from the repository root:

    .venv/bin/python scripts/bench_host_overhead.py              # full run, writes docs/benchmarks/host_overhead.md
    .venv/bin/python scripts/bench_host_overhead.py --smoke      # small sizes, well under a minute; no report
    .venv/bin/python scripts/bench_host_overhead.py --device cuda --mbu-preset llama3.2-1b --dtype bfloat16

In one run, on the bundled model (CPU float32 unless --device says otherwise), engine ``chunked``, decode
batches of 1 and 32 requests (prompts of 16 tokens, every request decoding to ``max_tokens``):

1. **Host time per decode step and its share of the step**, for each host-side option the engine exposes on
   this device, side by side: ``prepare_inputs="loop"`` (per-token Python input preparation) against
   ``"vectorized"`` (the default), and on CUDA also ``enforce_eager=False`` (CUDA graphs). Host time comes from a
   ``torch.profiler`` trace (``labkit.measure.profiling``): the
   part of each step in which the device had no work (on a CPU: the step minus the aten operators of the
   forward pass; see ``labkit/measure/profiling/trace_analysis.py``). Tracing slows every operator a little, so the
   untraced step time of the same configuration is reported beside it, and an estimate of the untraced host
   time (traced host share x untraced step time).
2. **transformers' own ``generate``** on the same checkpoint (greedy, EOS ignored) at the same batch sizes:
   per-step time = (time for N2 tokens - time for N1 tokens) / (N2 - N1), so prefill cancels out. The goal
   (issue 7): ``chunked``'s per-step host overhead at batch 1 <= 1/3 of transformers' per-step time.
3. With ``--mbu-preset``: decode MBU at batch 1 on that preset (random weights), per configuration; on a GPU
   that is where CUDA graphs show (a ~1B model in bf16: ``--mbu-preset llama3.2-1b --dtype bfloat16``).

Configurations alternate round by round so that a burst of load from other programs hits them alike; every
figure is a median. Benchmarks are scripts, not timed tests: compare side by side in one run, report ratios, name
the hardware. Notebook 10 explains the terms; the parts live in ``labkit.measure.benchmarks.host_overhead`` and
``labkit.measure.benchmarks.host_overhead_report``.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from labkit.core.model.source import bundled_model_path
from labkit.measure.benchmarks.cli import REPO_ROOT, bench_parser, start_bench
from labkit.measure.benchmarks.host_overhead import (
    FULL,
    SMOKE,
    chunked_engines,
    configurations,
    measure_cells,
    measure_mbu,
)
from labkit.measure.benchmarks.host_overhead_report import report
from labkit.measure.benchmarks.report import finish_report
from labkit.measure.hardware import probe
from labkit.measure.load import OtherLoad

DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "host_overhead.md"


def main() -> int:
    parser = bench_parser("host time per engine step, before and after the host-side fixes", DEFAULT_OUT,
                          device_help="cpu (default), cuda or auto")
    parser.add_argument("--mbu-preset", default=None, help="also measure decode MBU at batch 1 on this preset")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else FULL
    bench = start_bench(args, "bench_host_overhead.py", DEFAULT_OUT)
    device, dtype = bench.device, bench.dtype
    assert dtype is not None  # bench_parser gave it --dtype
    other_load = OtherLoad()

    configs = configurations(device)
    llms, prompts = chunked_engines(configs, device, dtype, sizes)
    from transformers import AutoModelForCausalLM  # late: the slowest import, and only this comparison needs it
    hf_model = AutoModelForCausalLM.from_pretrained(bundled_model_path(), dtype=dtype).to(device).eval()
    with tempfile.TemporaryDirectory(prefix="bench-host-") as logdir:
        cells, hf = measure_cells(llms, hf_model, prompts, sizes, device, Path(logdir))
    del llms, hf_model

    mbu_rows, roof = None, None
    if args.mbu_preset:
        roof = probe(device, dtype, smoke=args.smoke)
        mbu_rows = measure_mbu(args.mbu_preset, device, dtype, configs, sizes, roof)

    load = other_load.fraction()
    text = report(bench.command, bench.hw, sizes, dtype, cells, hf, mbu_rows, args.mbu_preset, roof,
                  time.perf_counter() - bench.t0, load)
    finish_report(text, bench.out, load)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
