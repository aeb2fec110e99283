"""Speculative decoding against plain decoding on the bundled model: acceptance rate, speed-up, p99 ITL.

Plain decoding, prompt lookup (ngram) and the self-speculative draft (the target's first layer) run side by side in
interleaved rounds (labkit.measure.rounds.interleave), on a workload whose answer is quoted in the prompt and on
fresh story openings, at batch 1 and at a larger batch. Speed-ups are taken round by round (each contender's tokens/s
over plain decoding's in the same round) and reported as the median with the rounds' range.

    .venv/bin/python scripts/bench_spec_decode.py            # writes docs/benchmarks/spec_decode.md
    .venv/bin/python scripts/bench_spec_decode.py --smoke    # tiny sizes, no report
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402  (scripts/ is on sys.path)
    ROOT,
    OtherLoad,
    bench_parser,
    finish_report,
    md_table,
    report_header,
    start_bench,
)

from labkit import LLM, SamplingParams  # noqa: E402
from labkit.measure.rounds import interleave  # noqa: E402
from labkit.measure.spec_decode import contender, fresh_prompts, quoting_prompts  # noqa: E402

DEFAULT_OUT = ROOT / "docs" / "benchmarks" / "spec_decode.md"
SPECS = {
    "plain": None,
    "ngram k=3": {"method": "ngram", "num_speculative_tokens": 3},
    "draft (1 layer) k=3": {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 1},
}


def main() -> None:
    parser = bench_parser("speculative decoding vs plain decoding on the bundled model", DEFAULT_OUT)
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; 2 with --smoke)")
    args = parser.parse_args()
    bench = start_bench(args, "bench_spec_decode.py", DEFAULT_OUT)
    other_load = OtherLoad()
    rounds_n = args.rounds or (2 if args.smoke else 3)
    max_tokens, big_batch = (24, 4) if args.smoke else (96, 16)
    llms = {name: LLM("labkit-tiny", engine="chunked", device=str(bench.device), dtype=str(bench.dtype).split(".")[-1],
                      **({"speculative_config": spec} if spec else {})) for name, spec in SPECS.items()}
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    quote_pool = quoting_prompts(llms["plain"], big_batch, length=max_tokens + 16)
    workloads = {("quoting", 1): quote_pool[:1], ("quoting", big_batch): quote_pool,
                 ("fresh", 1): fresh_prompts(1), ("fresh", big_batch): fresh_prompts(big_batch)}
    rows = []
    for (kind, batch), prompts in workloads.items():
        print(f"{kind} prompts, batch {batch}")
        rounds = interleave({n: contender(llm, prompts, params) for n, llm in llms.items()}, rounds_n,
                            device=bench.device)
        for name in llms:
            speedups = rounds.ratios(name, "plain", "tokens_per_s")
            acc = (f"{rounds.median(name, 'acceptance_rate'):.0%}" if name != "plain" else "-")
            rows.append([kind, str(batch), name, acc,
                         f"{rounds.median(name, 'tokens_per_s'):.0f}",
                         f"{statistics.median(speedups):.2f}x ({min(speedups):.2f}-{max(speedups):.2f})",
                         f"{rounds.median(name, 'itl_p99_ms'):.1f}"])
    load = other_load.fraction()
    lines = report_header("Benchmark: speculative decoding vs plain decoding", bench.command, bench.hw,
                          time.perf_counter() - bench.t0, load)
    lines += [f"Bundled model, engine `chunked`, greedy, {max_tokens} output tokens per request, median of "
              f"{rounds_n} interleaved rounds (speed-up: round by round over plain decoding; range in brackets). "
              "Greedy output is identical in every row (tests/core/spec_decode).", "",
              md_table(["workload", "batch", "decoding", "acceptance", "tokens/s", "speed-up", "ITL p99 (ms)"], rows)]
    finish_report("\n".join(lines) + "\n", bench.out, load)


if __name__ == "__main__":
    main()
