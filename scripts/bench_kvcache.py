"""Benchmark the KV cache: naive vs kvcache decode cost side by side, and decode MBU on a real shape.

Run from the repository root:

    .venv/bin/python scripts/bench_kvcache.py              # full run, ~3-5 min on 2 CPU cores
    .venv/bin/python scripts/bench_kvcache.py --smoke      # small sizes, well under a minute
    .venv/bin/python scripts/bench_kvcache.py --out docs/benchmarks/kvcache.md

A full run writes docs/benchmarks/kvcache.md (a smoke run writes a file only when given --out). In one run:

1. Per-token decode cost at several context lengths, engine ``naive`` (recomputes the whole sequence every
   step) against ``kvcache`` (one new token per step against a contiguous cache), on the bundled model:
   the median decode-step time at each context, and their ratio (notebooks 02-03).
2. Total time to generate N tokens with each engine: quadratic against linear.
3. Decode MBU at batch 1 on a preset of a real architecture (``smollm2-135m``: 135M parameters, random
   weights): the median decode-step time, the bytes that step must move (``labkit.measure.roofline.decode_cost``)
   and the bandwidth roof measured in this same run (``labkit.measure.hardware.probe``, full size). MBU = achieved
   bytes/s over the roof (notebook 04).
4. Where a decode step's time goes: engine stages, a profile of the forward pass by operator, the floor set
   by the matmul kernels alone (every weight matrix times one vector, nothing else), and the attention call
   as labkit makes it against a fused grouped-query call.
5. The same decode step against the matrix-vector (GEMV) baselines (``labkit.measure.decode_roof``): the bandwidth
   a plain GEMV reaches on a 256 MiB matrix with each kernel (``F.linear``, ``x @ W`` over an (in, out) weight,
   oneDNN's packed layout). These are libraries' rates, baselines under the roof, which is the memory's: the
   streaming-read bandwidth (part 3's probe; ``decode_roof.read_roof``), what no kernel can beat and what labkit's
   own GEMV kernels aim at (``scripts/bench_quantization.py``). Then the whole step with labkit's linear kernels
   (``labkit.core.model.linear``, "auto") and with ``F.linear`` everywhere ("torch"), in interleaved rounds, each
   split into linear layers, attention and everything else. Goal (issue #24): the whole step at >= 0.80 of the
   plain GEMV baseline (still named "GEMV roof" in the report's figures).

Benchmarks are scripts, not timed tests: compare side by side in one run, report ratios, name the hardware.
Timings synchronise the device before reading the clock (``StageClock``, ``labkit.measure.timing``). The parts live
in ``labkit.measure.benchmarks.kvcache`` and ``labkit.measure.benchmarks.kvcache_report``.
"""

from __future__ import annotations

import sys
import time

from labkit.measure.benchmarks.cli import REPO_ROOT, bench_parser, start_bench
from labkit.measure.benchmarks.kvcache import (
    FULL,
    SMOKE,
    measure_breakdown,
    measure_decode_points,
    measure_generation,
    measure_mbu,
    measure_roof_rounds,
    naive_and_kvcache,
    preset_llm,
)
from labkit.measure.benchmarks.kvcache_report import report
from labkit.measure.benchmarks.report import finish_report
from labkit.measure.decode_roof import measure_gemv_roof
from labkit.measure.hardware import probe
from labkit.measure.load import OtherLoad

DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "kvcache.md"
MODEL = "labkit-tiny"  # parts 1 and 2


def main() -> int:
    parser = bench_parser("naive vs kvcache decode cost, and decode MBU on a preset", DEFAULT_OUT)
    parser.add_argument("--preset", default="smollm2-135m", help="preset for the MBU measurement")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else FULL
    bench = start_bench(args, "bench_kvcache.py", DEFAULT_OUT)
    device, dtype = bench.device, bench.dtype
    assert dtype is not None  # bench_parser gave it --dtype

    other_load = OtherLoad()
    roof = probe(device, dtype, smoke=args.smoke)
    print(roof.summary())
    gemv = measure_gemv_roof(device, dtype, nbytes=sizes.gemv_bytes)
    print(gemv.summary())

    llms = naive_and_kvcache(MODEL, device, dtype, sizes)
    points = measure_decode_points(llms, sizes.contexts, sizes.decode_steps)
    runs = measure_generation(llms, sizes.gen_prompt_len, sizes.gen_tokens)
    del llms

    big = preset_llm(args.preset, device, dtype, sizes)
    res = measure_mbu(big, args.preset, sizes.mbu_context, sizes.mbu_steps)
    bd = measure_breakdown(big.model, sizes.mbu_context, sizes.profile_steps)
    roof_rounds = measure_roof_rounds(big, gemv, sizes.mbu_context, sizes.mbu_steps, sizes.roof_rounds)

    load = other_load.fraction()
    text = report(bench.command, bench.hw, roof, sizes, MODEL, points, runs, res, bd, roof_rounds,
                  time.perf_counter() - bench.t0, load)
    finish_report(text, bench.out, load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
