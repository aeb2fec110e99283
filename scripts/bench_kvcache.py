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
5. The same decode step against the matrix-vector (GEMV) roof (``labkit.measure.decode_roof``): the bandwidth a
   plain GEMV reaches on a 256 MiB matrix with each kernel (``F.linear``, ``x @ W`` over an (in, out) weight,
   oneDNN's packed layout), then the whole step with labkit's linear kernels (``labkit.core.model.linear``, "auto")
   and with ``F.linear`` everywhere ("torch"), in interleaved rounds, each split into linear layers, attention
   and everything else. Goal (issue #24): the whole step at >= 0.80 of the plain GEMV roof.

Benchmarks are scripts, not tests (DESIGN.md §6): compare side by side in one run, report ratios, name the
hardware. Timings synchronise the device before reading the clock (``StageClock``, ``time_fn``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, not installed
from bench_common import OtherLoad, bench_parser, finish_report, start_bench  # noqa: E402  (scripts/ is on sys.path)
from benchlib.kvcache_measure import (  # noqa: E402
    FULL,
    SMOKE,
    decode_steps,
    measure_breakdown,
    measure_decode_points,
    measure_generation,
    measure_mbu,
    measure_roof_rounds,
)
from benchlib.kvcache_report import report  # noqa: E402

from labkit import LLM  # noqa: E402
from labkit.course.workloads import prompt_ids_of_length  # noqa: E402
from labkit.measure.decode_roof import measure_gemv_roof  # noqa: E402
from labkit.measure.hardware import probe  # noqa: E402

DEFAULT_OUT = ROOT / "docs" / "benchmarks" / "kvcache.md"


def main() -> int:
    parser = bench_parser("naive vs kvcache decode cost, and decode MBU on a preset", DEFAULT_OUT)
    parser.add_argument("--preset", default="smollm2-135m", help="preset for the MBU measurement")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else FULL
    bench = start_bench(args, "bench_kvcache.py", DEFAULT_OUT)
    out, command, device, dtype, hw, t0 = bench.out, bench.command, bench.device, bench.dtype, bench.hw, bench.t0

    other_load = OtherLoad()
    roof = probe(device, dtype, smoke=args.smoke)
    print(roof.summary())
    gemv = measure_gemv_roof(device, dtype, nbytes=sizes.gemv_bytes)
    print(gemv.summary())

    max_len = max(sizes.contexts) + sizes.decode_steps + 2
    model_name = "labkit-tiny"
    llms = {name: LLM(model_name, engine=name, device=device, dtype=dtype,
                      max_model_len=max(max_len, sizes.gen_prompt_len + sizes.gen_tokens))
            for name in ("naive", "kvcache")}
    for llm in llms.values():  # warm-up: first calls allocate and pick kernels
        decode_steps(llm, prompt_ids_of_length(llm.tokenizer, 32, seed=0), 4)
    points = measure_decode_points(llms, sizes.contexts, sizes.decode_steps)
    runs = measure_generation(llms, sizes.gen_prompt_len, sizes.gen_tokens)
    del llms

    big = LLM(args.preset, engine="kvcache", device=device, dtype=dtype,
              max_model_len=sizes.mbu_context + sizes.mbu_steps + 2)
    decode_steps(big, prompt_ids_of_length(big.tokenizer, 16, seed=0), 3)  # warm-up
    res = measure_mbu(big, args.preset, sizes.mbu_context, sizes.mbu_steps)
    bd = measure_breakdown(big.model, sizes.mbu_context, sizes.profile_steps)
    roof_rounds = measure_roof_rounds(big, gemv, sizes.mbu_context, sizes.mbu_steps, sizes.roof_rounds)

    load = other_load.fraction()
    text = report(command, hw, roof, sizes, model_name, points, runs, res, bd, roof_rounds, time.perf_counter() - t0,
                  load)
    finish_report(text, out, load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
